"""A small model whose first Linear overflows fp16, for re-runs in a worker process: ``build`` notes the process
it runs in (``$PL_PROBE_PIDS``), ``build_crashing`` ends any worker process that builds it."""

import multiprocessing
import os

import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def build():
    where = os.environ.get("PL_PROBE_PIDS")
    if where:
        with open(where, "a") as f:
            f.write(f"{os.getpid()}\n")
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.up.weight.mul_(4000.0)
    return net


def build_crashing():
    if multiprocessing.parent_process() is not None:
        os._exit(3)
    return build()


def inputs():
    torch.manual_seed(1)
    return torch.randn(4, 16) * 30
