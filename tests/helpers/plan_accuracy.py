"""The real side of the planner accuracy tests (tests/distributed/test_plan_accuracy*.py, test_single_rank.py):
the trainer's step measured by torch's FSDPMemTracker on real gloo ranks, and the tolerance the planner
must meet. The method is in tests/distributed/test_plan_accuracy.py's docstring."""

from __future__ import annotations

TOL = 0.15
MID = ["--model.preset=debug", "--model.dim=256", "--model.n_layers=4", "--model.ffn_dim=768", "--model.vocab_size=8192"]


def plan_config(overrides: list[str], ac: str):
    """The config of a case, as both sides (real and planned) take it."""
    from shardlm.config import load_config

    # the real side runs on CPU, where parallel.reshard_after_forward=auto keeps only the last block (= true);
    # the planner plans auto for a GPU of --gpu-mem-gib (tests/unit/test_plan.py), so say true on both sides
    return load_config(None, ["--parallel.reshard_after_forward=true", *overrides, f"--train.ac={ac}"])


def real_worker(cases: dict) -> dict:
    """On each rank (`run_ranks`): per case, the tracker's real peak of the trainer's step 2 (rank 0's: "peak"),
    its categories ("split") and the gradient bytes after the first and last micro-batch ("grads").
    Imports `forward_backward` when it runs, so a test may replace `shardlm.train.step.forward_backward`."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from shardlm.build import build_model, build_model_config
    from shardlm.data.loader import IGNORE_INDEX
    from shardlm.distributed.env import init_distributed
    from shardlm.parallel.dims import ParallelDims
    from shardlm.parallel.fsdp import clip_grad_norm_
    from shardlm.plan.tracker import track_unmanaged
    from shardlm.train.optim import build_optimizer
    from shardlm.train.step import forward_backward

    env = init_distributed("cpu")
    out = {}
    for name, (overrides, ac) in cases.items():
        cfg = plan_config(overrides, ac)
        t = cfg.train
        dims = ParallelDims(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, env.world_size)
        mesh = dims.build_mesh("cpu")
        mc = build_model_config(cfg, 0)
        model = build_model(cfg, mc, mesh, torch.device("cpu"))  # the trainer's recipe, real tensors
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(model, t, torch.device("cuda"))  # fused, as on CUDA

        gen = torch.Generator().manual_seed(env.rank)

        def batch():
            d = torch.randint(0, mc.vocab_size, (t.micro_batch_size, cfg.data.seq_len + 1), generator=gen)
            return d[:, :-1].contiguous(), d[:, 1:].contiguous()

        grads = {}

        def grad_bytes(tracker) -> int:
            snap = tracker.get_tracker_snapshot("current")
            return sum(v for dev in snap.values() for k, v in dev.items()
                       if str(getattr(k, "value", k)) in ("Sharded Grad", "Unsharded Grad"))

        def train_step(batches, tracker=None):  # Trainer.train_step, on CPU
            counts = torch.tensor([float(sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)), 0.0])
            dist.all_reduce(counts)

            def reset(k):
                if k and tracker is not None:
                    grads.setdefault("mid", grad_bytes(tracker))  # after the first micro-batch's backward
                    tracker.reset_mod_stats()  # else it refuses a second root forward

            loss_sum = forward_backward(model, batches, dims.dp / counts[0].item(), torch.device("cpu"),
                                        t.grad_sync, dims.hsdp, before_micro_batch=reset,
                                        loss_chunk_tokens=t.loss_chunk_tokens)
            if tracker is not None:
                grads["end"] = grad_bytes(tracker)  # after the last backward
            clip_grad_norm_(params, t.grad_clip, flag=loss_sum)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        train_step([batch() for _ in range(t.grad_accum)])  # step 1: creates the optimizer state
        batches = [batch() for _ in range(t.grad_accum)]
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs(tuple(batches))
        unmanaged = track_unmanaged(tracker, model)  # on one rank: the parameters FSDP leaves alone
        with tracker:
            train_step(batches, tracker)
        for h in unmanaged:
            h.remove()
        peak = tracker.get_tracker_snapshot("peak")
        out[name] = {"peak": sum(dev["Total"] for dev in peak.values()),
                     "split": {str(getattr(k, "value", k)): v for dev in peak.values() for k, v in dev.items()},
                     "grads": grads}
        del model, optimizer, params, tracker, batches
    return out
