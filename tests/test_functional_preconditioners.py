"""The pure functions behind the matrix optimizers (issue 22): ``muon``, ``shampoo`` and ``soap``
from ``matrix_owner_optim.preconditioners``, called on lists of tensors with explicit
hyperparameters, update bitwise as the classes' ``step()`` (which gather for them)."""

from __future__ import annotations

import copy

import torch

from matrix_owner_optim.preconditioners import SOAP, Muon, Shampoo, muon, shampoo, soap


def _pair(shape: tuple[int, ...] = (24, 40)) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(*shape))
    return p, torch.nn.Parameter(p.detach().clone())


def _grads(steps: int, shape: tuple[int, ...] = (24, 40)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(steps)]


def test_muon_function_is_the_class_step() -> None:
    p, q = _pair()
    opt = Muon([p], lr=0.02, ns_dtype=torch.float32)
    hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    buf = torch.zeros_like(q)
    for g in _grads(3):
        p.grad = g.clone()
        opt.step()
        muon([q.detach()], [g.clone()], [buf], **hyper)
    assert torch.equal(p.detach(), q.detach())
    assert torch.equal(opt.state[p]["momentum_buffer"], buf)


def test_shampoo_function_is_the_class_step() -> None:
    p, q = _pair()
    options = {"lr": 0.05, "max_preconditioner_dim": 16, "grafting": "adam", "momentum": 0.5, "weight_decay": 0.01}
    a, b = Shampoo([p], **options), Shampoo([q], **options)
    grads = _grads(4)
    for opt, param in ((a, p), (b, q)):  # the first step makes the state (the class's job)
        param.grad = grads[0].clone()
        opt.step()
    state = copy.deepcopy(b.state[q])
    hyper = {k: v for k, v in b.param_groups[0].items() if k != "params"}
    for g in grads[1:]:
        p.grad = g.clone()
        a.step()
        shampoo([q.detach()], [g.clone()], [state], **hyper)
    assert torch.equal(p.detach(), q.detach())
    assert state.keys() == a.state[p].keys() and state["step"] == a.state[p]["step"] == 4
    assert all(torch.equal(v, a.state[p][k]) for k, v in state.items() if isinstance(v, torch.Tensor))


def test_soap_function_is_the_class_step() -> None:
    p, q = _pair()
    a, b = SOAP([p], lr=0.01, precondition_frequency=2), SOAP([q], lr=0.01, precondition_frequency=2)
    grads = _grads(5)
    for opt, param in ((a, p), (b, q)):  # the first call builds factors and bases (the class's job)
        param.grad = grads[0].clone()
        opt.step()
    state = copy.deepcopy(b.state[q])
    hyper = {k: v for k, v in b.param_groups[0].items() if k != "params"}
    hyper["shampoo_beta"] = hyper["betas"][1]  # the class resolves None to beta2
    for g in grads[1:]:
        p.grad = g.clone()
        a.step()
        soap([q.detach()], [g.clone()], [state], **hyper)
    assert torch.equal(p.detach(), q.detach())
    assert all(torch.equal(v, a.state[p][k]) for k, v in state.items() if isinstance(v, torch.Tensor))
