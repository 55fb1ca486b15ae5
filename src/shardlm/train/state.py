"""What a checkpoint holds of the trainer besides model and optimizer: a `Stateful` the checkpointer owns."""

from __future__ import annotations

import torch


class TrainState:
    """Optimizer steps done, the data position and the RNG streams, as tensors (DCP needs no pickles).

    On disk: `trainer.step`, `trainer.samples_seen`, `trainer.rng_cpu` (+ `trainer.rng_cuda` on GPUs).
    """

    def __init__(self, loader, device: torch.device, step: int = 0):
        self.loader, self.device, self.step = loader, device, step

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"step": torch.tensor(self.step), "samples_seen": torch.tensor(int(self.loader.samples_seen)),
                 "rng_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.step = int(state["step"])
        self.loader.load_state_dict({"samples_seen": int(state["samples_seen"])})
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state:
            torch.cuda.set_rng_state(state["rng_cuda"], self.device)
