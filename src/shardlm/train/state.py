"""What a checkpoint holds of the trainer besides model and optimizer: a `Stateful` the checkpointer owns."""

from __future__ import annotations

import torch

_OWN = ("step", "rng_cpu", "rng_cuda")


class TrainState:
    """Optimizer steps done, the data position and the RNG streams, as tensors (DCP needs no pickles).

    On disk: `trainer.step`, `trainer.rng_cpu` (+ `trainer.rng_cuda` on GPUs), and the loader's state
    (`trainer.samples_seen`, `trainer.order_version`; a mixture's per-source `consumed`, `base`, `weights`, `caps`).
    """

    def __init__(self, loader, device: torch.device, step: int = 0):
        self.loader, self.device, self.step = loader, device, step

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"step": torch.tensor(self.step), "rng_cpu": torch.get_rng_state(),
                 **{k: torch.as_tensor(v) for k, v in self.loader.state_dict().items()}}
        if self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_template(self, saved: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
        """What to load into: every key the checkpoint holds, at its own shape and dtype, so that a data state
        of another shape (an older order, another number of sources) reaches `load_state_dict`, which says
        what differs in one line, instead of failing inside DCP."""
        return {k: torch.empty(size, dtype=dtype) for k, (size, dtype) in saved.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.step = int(state["step"])
        self.loader.load_state_dict({k: v for k, v in state.items() if k not in _OWN})
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"], self.device)
