"""A plain PyTorch training loop that checkpoints to a directory.

Nothing here knows about ckptfs: point --save-dir at a ckptfs mount or at any
other directory and the code is the same. That is the point of ckptfs.

The model is an MLP on synthetic data, sized by --params-mb. Every
--save-every steps it saves {'model', 'optim', 'step'} with torch.save to a
temporary name, renames it into place (so a crash never leaves a half-written
stepNNNNNN.pt), and deletes older checkpoints so the last two remain; with
--fsync it first flushes the file to disk, as a careful script does when the
checkpoint must be on disk once the save returns. Each save prints how long
training was blocked by it.

    python examples/train.py --save-dir /ckpt --steps 100 --save-every 10
    python examples/train.py --save-dir /ckpt --steps 200 --save-every 10 --resume
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path

import torch
from torch import nn

CKPT_RE = re.compile(r"^step(\d{6})\.pt$")
KEEP = 2


def build_model(params_mb: float, width: int) -> nn.Module:
    """An MLP of `width`-wide layers holding about `params_mb` MiB of fp32 parameters."""
    layer_bytes = 4 * (width * width + width)
    depth = max(1, round(params_mb * 2**20 / layer_bytes))
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


def batch(step: int, batch_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch; the same step always gets the same data (so a resumed run matches)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, width, generator=g)
    return x, torch.sin(x)


def checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `save_dir`, oldest first."""
    found = []
    for p in save_dir.iterdir():
        m = CKPT_RE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(save_dir: Path, step: int, model: nn.Module, optim: torch.optim.Optimizer,
                    fsync: bool = False) -> Path:
    path = save_dir / f"step{step:06d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, tmp)
    if fsync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    tmp.replace(path)
    for _, old in checkpoints(save_dir)[:-KEEP]:
        old.unlink()
    return path


def load_latest(save_dir: Path, model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint that loads; returns its step (0 when there is none)."""
    for step, path in reversed(checkpoints(save_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - fall back to the previous checkpoint
            print(f"cannot load {path}: {e}; trying an older one", flush=True)
            continue
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        print(f"resumed from {path} (step {state['step']})", flush=True)
        return int(state["step"])
    print(f"no checkpoint in {save_dir}: starting from scratch", flush=True)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10, help="train until this step")
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--fsync", action="store_true", help="fsync each checkpoint before renaming it into place")
    p.add_argument("--params-mb", type=float, default=64, help="model size in MiB of fp32 parameters")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.steps < 0 or args.save_every < 1:
        p.error("--steps must be >= 0 and --save-every >= 1")

    torch.manual_seed(args.seed)
    args.save_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(args.params_mb, args.width)
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    nparams = sum(t.numel() for t in model.parameters())
    print(f"model: {nparams / 1e6:.1f}M parameters ({nparams * 4 / 2**20:.0f} MiB); "
          f"checkpoint with Adam state ~{3 * nparams * 4 / 2**20:.0f} MiB", flush=True)

    start = load_latest(args.save_dir, model, optim) if args.resume else 0
    step_times, save_times = [], []
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = batch(step, args.batch_size, args.width)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        step_times.append(time.perf_counter() - t0)
        print(f"step {step}: loss {loss.item():.4f}, {step_times[-1]:.3f} s", flush=True)
        if step % args.save_every == 0:
            started = time.time()
            t0 = time.perf_counter()
            path = save_checkpoint(args.save_dir, step, model, optim, args.fsync)
            save_times.append(time.perf_counter() - t0)
            size_mb = path.stat().st_size / 2**20
            print(f"step {step}: saved {path.name} ({size_mb:.1f} MiB) in {save_times[-1]:.3f} s "
                  f"({size_mb / save_times[-1]:.0f} MiB/s), started at {started:.3f}", flush=True)

    if step_times:
        print(f"done: {len(step_times)} steps, median step {statistics.median(step_times):.3f} s", flush=True)
    if save_times:
        print(f"done: {len(save_times)} saves, median blocked {statistics.median(save_times):.3f} s, "
              f"max {max(save_times):.3f} s", flush=True)


if __name__ == "__main__":
    main()
