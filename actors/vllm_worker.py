"""The worker side of turnscale's vLLM weight swaps: a ``worker_extension_cls``.

vLLM mixes ``TurnscaleWorkerExtension`` into its worker class (in every worker process, or
in this process in vLLM's in-process mode), so the engine calls its methods by *name*
through ``LLM.collective_rpc`` — no function or tensor is pickled; the only argument is a
list of file paths (``actors.vllm_state``: the full state in shared memory).

This module imports neither vLLM nor torch at import time (vLLM imports it by qualified
name inside each worker).
"""

from __future__ import annotations

from typing import Any, Sequence

EXTENSION = "actors.vllm_worker.TurnscaleWorkerExtension"


class TurnscaleWorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker)."""

    def turnscale_load_state(self, files: Sequence[str]) -> int:
        """Load the full state in ``files`` (safetensors, HF names) into this worker's model
        through vLLM's in-place reload (checkpoint format: vLLM's own loader fuses and
        repacks, e.g. the CPU backend's repacked linears).  Returns the tensors read.

        Ordering: returns only after every tensor is in place; an exception may leave the
        model half-written, which the engine repairs by loading its restore source.
        """
        from actors.vllm_state import iter_state

        count = 0

        def counted() -> Any:
            nonlocal count
            for item in iter_state(list(files)):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return count
