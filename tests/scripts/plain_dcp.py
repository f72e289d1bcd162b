"""A plain torch program (no dataparallel) that reads or writes a DCP checkpoint.

    plain_dcp.py load FOLDER OUT    # get_state_dict + dcp.load + set_state_dict; OUT: the state
    plain_dcp.py save FOLDER REF    # two Adam steps, dcp.save of get_state_dict; REF: the state

OUT and REF hold {"model", "optim", "step"} in torch's plain formats (`torch.save`). Several
MODE FOLDER PATH steps in one command run in turn, each with a model and an optimizer of its
own (one process's start for all).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def run_step(mode: str, folder: str, out: str) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if mode == "load":
        model_sd, optim_sd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        done = state["step"]
    else:
        for number in range(2):
            g = torch.Generator().manual_seed(7 + number)
            model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        done = 2
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": done}, checkpoint_id=folder)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": done}, out)


def main() -> None:
    args = sys.argv[1:]
    assert len(args) % 3 == 0 and args, "steps come in threes: MODE FOLDER PATH"
    assert "dataparallel" not in sys.modules
    for i in range(0, len(args), 3):
        mode, folder, out = args[i : i + 3]
        assert mode in ("load", "save"), mode
        run_step(mode, folder, out)
    assert "dataparallel" not in sys.modules


if __name__ == "__main__":
    main()
