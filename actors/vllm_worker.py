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

EXTENSION = "turnscale.actors.vllm_worker.TurnscaleWorkerExtension"


class TurnscaleWorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker)."""

    def turnscale_load_state(self, files: Sequence[str]) -> int:
        """Load the full state in ``files`` (safetensors, HF names) into this worker's model
        through vLLM's in-place reload (checkpoint format: vLLM's own loader fuses and
        repacks, e.g. the CPU backend's repacked linears).  Returns the tensors read.

        Ordering: returns only after every tensor is in place.  On an exception the model
        is half-written: vLLM's layer-wise reload is first taken out of its loading mode
        (``_leave_reload_mode``; otherwise no later reload can work), then the exception
        propagates and the engine loads its restore source.
        """
        from turnscale.actors.vllm_state import iter_state

        count = 0

        def counted() -> Any:
            nonlocal count
            for item in iter_state(list(files)):
                count += 1
                yield item

        try:
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        except BaseException:
            self._leave_reload_mode()
            raise
        return count

    def _leave_reload_mode(self) -> None:
        """After an interrupted in-place reload: put back the kernel tensors of layers that
        received nothing and process the rest (vLLM's ``finalize_layerwise_reload``, which
        the interrupted ``reload_weights`` never reached).  Weights stay half-written; a
        failure here is logged and left to the engine's restore (which then reports the
        engine broken)."""
        import logging

        try:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            runner = self.model_runner  # type: ignore[attr-defined]
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                finalize_layerwise_reload(runner.get_model(), self.vllm_config.model_config)  # type: ignore[attr-defined]
        except Exception:
            logging.getLogger(__name__).exception("could not leave vLLM's layer-wise reload mode after a failed swap")
