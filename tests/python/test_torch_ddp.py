"""A model prepared at O1 trains under DistributedDataParallel (2 CPU
processes, gloo) to the same weights as one process on the whole batch."""
import os
import socket
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import tensor_ops.torch as tt  # noqa: E402
from test_torch_integration import rel_err, tiny_llama  # noqa: E402

WORLD = 2
STEPS = 3
TIMEOUT_S = 240  # each worker imports torch and tensor_ops (an editable install may rebuild)


def batch():
    g = torch.Generator().manual_seed(20)
    return torch.randint(0, 96, (4, 12), generator=g), torch.randint(0, 96, (4, 12), generator=g)


def train(model, ids, target, steps=STEPS):
    """SGD on the mean token cross-entropy; returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = tt.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model, _ = tt.prepare_model(tiny_llama(seed=3), "O1")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ids, target = batch()
        rows = slice(rank * 2, rank * 2 + 2)  # equal shards: the mean of shard means is the batch mean
        losses = train(ddp, ids[rows], target[rows])
        torch.save({"state": model.state_dict(), "losses": losses}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_match_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSOR_OPS_NUM_THREADS", "1")
    ctx = torch.multiprocessing.start_processes(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD,
                                                join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                pytest.fail(f"DDP workers still running after {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()

    model, _ = tt.prepare_model(tiny_llama(seed=3), "O1")
    ids, target = batch()
    losses = train(model, ids, target)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name, p in model.state_dict().items():
        assert torch.equal(ranks[0]["state"][name], ranks[1]["state"][name]), f"ranks disagree on {name}"
        assert rel_err(ranks[0]["state"][name], p) < 1e-5, name
    for step, loss in enumerate(losses):  # the batch loss is the mean of the shard losses
        assert abs((ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2 - loss) < 1e-5 * loss, step
    assert losses[-1] < losses[0]  # it did train
