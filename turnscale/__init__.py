"""turnscale: asynchronous actor-learner multi-turn RL for LLM agents.

One import namespace, ``turnscale``, holds everything: the shared layers
(``turnscale.protocol``, ``turnscale.conf``, ``turnscale.common``), the roles
(``turnscale.envhub``, ``turnscale.actors``, ``turnscale.learner``), the test-cluster tools
(``turnscale.cluster``), the benchmarks (``turnscale.benchmarks``) and the application modules
of this folder (CLI, launcher, eval, viewer).  Nothing generic (``conf``, ``protocol``, ...) is
installed at the top level of site-packages.

In the repository those packages sit at the top of the tree (``protocol/``, ``actors/``, ...),
beside this folder.  A wheel maps them under ``turnscale/`` (``[tool.setuptools] package-dir``
in pyproject.toml).  Run from a source checkout (or an editable install of one), this package
also searches the repository root for its subpackages, so ``turnscale.actors`` is the checkout's
``actors/`` folder: the code a test or a role process runs is the code in that checkout.

This file is the namespace root and stays free of imports: importing ``turnscale.protocol``
pulls in no application module (docs/architecture.md, Layers).
"""

import os as _os

__version__ = "0.1.0"

# The mapped subpackages (pyproject.toml's package-dir); here once for the checkout case.
SUBPACKAGES = ("protocol", "conf", "common", "envhub", "actors", "learner", "benchmarks", "cluster")

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(_os.path.join(_root, "protocol", "__init__.py")):
    __path__.append(_root)  # a source checkout: turnscale.<pkg> -> <root>/<pkg>
