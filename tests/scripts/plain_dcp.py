"""A plain torch program (no dataparallel) that reads or writes a DCP checkpoint.

    plain_dcp.py load FOLDER OUT    # get_state_dict + dcp.load + set_state_dict; OUT: the state
    plain_dcp.py save FOLDER REF    # two Adam steps, dcp.save of get_state_dict; REF: the state

OUT and REF hold {"model", "optim", "step"} in torch's plain formats (`torch.save`).
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


def main() -> None:
    mode, folder, out = sys.argv[1:4]
    assert "dataparallel" not in sys.modules
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if mode == "load":
        model_sd, optim_sd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = state["step"]
    else:
        for step in range(2):
            g = torch.Generator().manual_seed(7 + step)
            model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        step = 2
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=folder)
    assert "dataparallel" not in sys.modules
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, out)


if __name__ == "__main__":
    main()
