"""OwnerRoutedOptimizer in one process, routing at simulated world sizes, and the registry."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from _ref import CFG4, max_param_rel_err_native, roundtrip
from matrix_owner_optim import OwnerRoutedOptimizer, plan_model, register_preconditioner
from matrix_owner_optim.optim import available_optimizers, simulated_parameters
from matrix_owner_optim.planning import Role
from matrix_owner_optim.planning.roles import module_roles
from matrix_owner_optim.preconditioners import SOAP, Muon, Shampoo
from matrix_owner_optim.toolbox.models import GPT, GPTConfig

CFG = CFG4


def twin_models(untied: bool = False) -> tuple[GPT, GPT]:
    cfg = GPTConfig(**{**CFG.__dict__, "tie_embeddings": not untied})
    a = GPT(cfg)
    b = copy.deepcopy(a)
    return a, b


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)) for _ in range(n)]


def test_equals_torch_muon_plus_adamw_under_cosine_schedule_with_resume() -> None:
    # batched=False: the path kept bitwise torch.optim.Muon (the batched default's bfloat16 fast
    # form is checked against it within bfloat16's noise in test_preconditioners)
    model, ref = twin_models()
    opt = OwnerRoutedOptimizer(
        model,
        matrix="muon",
        matrix_options={"lr": 0.02, "weight_decay": 0.01, "batched": False},
        tail="adamw",
        tail_options={"lr": 3e-3, "weight_decay": 0.05},
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    roles = module_roles(ref)
    mats = [p for p in ref.parameters() if roles[id(p)] is Role.MATRIX]
    rest = [p for p in ref.parameters() if roles[id(p)] is not Role.MATRIX]
    assert len(mats) == 8 and len(rest) == 20
    ref_opts = [torch.optim.Muon(mats, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.05)]
    ref_scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20) for o in ref_opts]
    losses = []
    for step, (x, y) in enumerate(batches(20)):
        loss = model(x, y)
        loss.backward()
        opt.step()
        child_lr = opt.matrix_optimizer.param_groups[0]["lr"]  # the lr the child stepped with
        opt.zero_grad()
        sched.step()
        ref_loss = ref(x, y)
        ref_loss.backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
        for s in ref_scheds:
            s.step()
        losses.append((loss.item(), ref_loss.item()))
        if step == 9:  # resume into a brand-new optimizer and scheduler from serialized state
            opt_sd, sched_sd = roundtrip(opt.state_dict()), roundtrip(sched.state_dict())
            opt = OwnerRoutedOptimizer(
                model,
                matrix="muon",
                matrix_options={"lr": 0.02, "weight_decay": 0.01, "batched": False},
                tail="adamw",
                tail_options={"lr": 3e-3, "weight_decay": 0.05},
            )
            opt.load_state_dict(opt_sd)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
            sched.load_state_dict(sched_sd)
    assert all(a == b for a, b in losses), losses
    assert max_param_rel_err_native(model, ref, floor=1e-12) == 0.0
    # the schedule moved the parent's lr, and the children used it (their groups read the parent's)
    assert opt.param_groups[0]["lr"] == ref_opts[0].param_groups[0]["lr"]
    assert opt.param_groups[1]["lr"] == ref_opts[1].param_groups[0]["lr"]
    assert 0 < child_lr < 0.02 * 0.01
    assert opt.matrix_optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]  # one value, no copy


def test_param_groups_have_the_same_structure_and_split_by_role() -> None:
    model, _ = twin_models()
    opt = OwnerRoutedOptimizer(model.named_parameters(), matrix_options={"lr": 0.02})
    # one group per tensor role ("role"), each naming the optimizer that steps it ("optimizer")
    assert [g["role"] for g in opt.param_groups] == ["matrix", "tail", "rows"]
    assert [g["optimizer"] for g in opt.param_groups] == ["matrix", "tail", "tail"]
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[1]["lr"] == opt.param_groups[2]["lr"] == 1e-3
    assert "betas" in opt.param_groups[1] and "ns_steps" in opt.param_groups[0]
    # names: wte (tied head) and wpe are embeddings -> tail optimizer; Linear weights -> matrix
    n_matrix = len(opt.param_groups[0]["params"])
    assert n_matrix == 8


@pytest.mark.parametrize("form", ["module", "named", "plain", "groups"])
def test_param_forms_route_linear_weights_to_matrix(form: str) -> None:
    model, _ = twin_models(untied=True)
    if form == "module":
        params = model
    elif form == "named":
        params = model.named_parameters()
    elif form == "plain":
        params = model.parameters()
    else:
        params = [
            {"params": list(model.layers.parameters()), "lr": 0.5},
            {"params": [model.wte.weight, model.wpe.weight, model.lm_head.weight], "role": "tail"},
            {"params": list(model.ln_f.parameters())},
        ]
    opt = OwnerRoutedOptimizer(params)
    routes = {r["name"]: r["role"] for r in opt.routes()}
    matrix_count = sum(1 for r in routes.values() if r == "matrix")
    if form == "plain":
        # no names: shapes decide, so the embeddings and head (2D) count as matrices too
        assert matrix_count == 8 + 3
    else:
        assert matrix_count == 8
    if form == "groups":
        lrs = {g["role"]: g["lr"] for g in opt.param_groups[:2]}
        assert lrs == {"matrix": 0.5, "tail": 0.5}


def test_roles_override_and_errors() -> None:
    model, _ = twin_models()
    opt = OwnerRoutedOptimizer(model, roles={"layers.*.mlp.fc.weight": "tail"})
    roles = {r["name"]: r["role"] for r in opt.routes()}
    assert roles["layers.0.mlp.fc.weight"] == "tail" and roles["layers.0.attn.qkv.weight"] == "matrix"
    with pytest.raises(ValueError, match="layers.0.ln1.weight"):
        OwnerRoutedOptimizer(model, roles={"layers.0.ln1.weight": "matrix"})
    with pytest.raises(ValueError, match="no.such"):
        OwnerRoutedOptimizer(model, roles={"no.such.param": "tail"})
    with pytest.raises(ValueError, match="unknown role"):
        OwnerRoutedOptimizer(model, roles={"layers.*": "vector"})
    with pytest.raises(ValueError, match=r"unknown matrix optimizer 'lion'.*muon.*shampoo.*soap"):
        OwnerRoutedOptimizer(model, matrix="lion")
    with pytest.raises(ValueError, match="matrix_options"):
        OwnerRoutedOptimizer(model, matrix_options={"not_an_option": 1})
    with pytest.raises(ValueError, match="'frobnicate'"):
        OwnerRoutedOptimizer([{"params": list(model.parameters()), "frobnicate": 1}])
    with pytest.raises(ValueError, match="empty parameter list"):
        OwnerRoutedOptimizer([])


def _train_alongside(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    ref: torch.nn.Module,
    ref_opts: list[torch.optim.Optimizer],
    steps: int,
) -> None:
    """``steps`` batches through the model with ``opt`` and the reference with ``ref_opts``."""
    for x, y in batches(steps):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        ref(x, y).backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()


def test_any_optimizer_class_becomes_a_matrix_optimizer() -> None:
    model, ref = twin_models()
    opt = OwnerRoutedOptimizer(
        model,
        matrix=torch.optim.SGD,
        matrix_options={"lr": 0.1, "momentum": 0.9},
        tail=torch.optim.Adam,
        tail_options={"lr": 1e-3},
    )
    roles = module_roles(ref)
    r1 = torch.optim.SGD([p for p in ref.parameters() if roles[id(p)] is Role.MATRIX], lr=0.1, momentum=0.9)
    r2 = torch.optim.Adam([p for p in ref.parameters() if roles[id(p)] is not Role.MATRIX], lr=1e-3)
    _train_alongside(model, opt, ref, [r1, r2], 5)
    assert max_param_rel_err_native(model, ref, floor=1e-12) == 0.0


@pytest.mark.parametrize("name,cls,opts", [("shampoo", Shampoo, {"lr": 0.01}), ("soap", SOAP, {"lr": 3e-3})])
def test_builtin_preconditioners_by_name(name: str, cls: type, opts: dict) -> None:
    model, ref = twin_models()
    opt = OwnerRoutedOptimizer(model, matrix=name, matrix_options=opts)
    assert isinstance(opt.matrix_optimizer, cls)
    roles = module_roles(ref)
    r1 = cls([p for p in ref.parameters() if roles[id(p)] is Role.MATRIX], **opts)
    r2 = torch.optim.AdamW([p for p in ref.parameters() if roles[id(p)] is not Role.MATRIX])
    _train_alongside(model, opt, ref, [r1, r2], 4)
    assert max_param_rel_err_native(model, ref, floor=1e-12) == 0.0


def test_torch_optimizer_shampoo_by_name() -> None:
    import torch_optimizer  # in the test extra: a missing install must fail, not skip

    model, ref = twin_models()
    opt = OwnerRoutedOptimizer(model, matrix="torch_optimizer_shampoo", matrix_options={"lr": 0.01})
    assert isinstance(opt.matrix_optimizer, torch_optimizer.Shampoo)
    roles = module_roles(ref)
    r1 = torch_optimizer.Shampoo([p for p in ref.parameters() if roles[id(p)] is Role.MATRIX], lr=0.01)
    r2 = torch.optim.AdamW([p for p in ref.parameters() if roles[id(p)] is not Role.MATRIX])
    _train_alongside(model, opt, ref, [r1, r2], 3)
    assert max_param_rel_err_native(model, ref, floor=1e-12) == 0.0


def test_conv_kernel_as_matrix_gets_a_2d_view() -> None:
    conv = nn.Conv2d(3, 8, 3, bias=False)
    ref_w = nn.Parameter(conv.weight.detach().reshape(8, -1).clone())
    opt = OwnerRoutedOptimizer([("conv.weight", conv.weight)], roles={"conv.*": "matrix"}, matrix_options={"lr": 0.05})
    ref = torch.optim.Muon([ref_w], lr=0.05)
    for _ in range(3):
        g = torch.randn(8, 3, 3, 3)
        conv.weight.grad = g.clone()
        ref_w.grad = g.reshape(8, -1).clone()
        opt.step()
        ref.step()
    assert torch.equal(conv.weight.detach().reshape(8, -1), ref_w.detach())
    assert opt.state_dict()["state"][0]["momentum_buffer"].shape == (8, 27)


def test_add_param_group_zero_grad_and_closure() -> None:
    a = nn.Linear(8, 8)
    b = nn.Linear(8, 4)
    opt = OwnerRoutedOptimizer(a.named_parameters())
    opt.add_param_group({"params": list(b.named_parameters()), "lr": 0.3})
    assert [g["role"] for g in opt.param_groups] == ["matrix", "tail", "matrix", "tail"]
    assert opt.param_groups[2]["lr"] == 0.3
    x = torch.randn(5, 8)

    def closure():
        opt.zero_grad()
        loss = b(a(x)).square().mean()
        loss.backward()
        return loss

    before = b.weight.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert not torch.equal(before, b.weight)
    opt.zero_grad(set_to_none=False)
    assert torch.count_nonzero(b.weight.grad) == 0
    opt.zero_grad()
    assert b.weight.grad is None
    with pytest.raises(ValueError, match="already in another param group"):
        opt.add_param_group({"params": [a.weight]})


@pytest.mark.parametrize("world_size", [2, 3, 8, 64, 1024])
def test_routing_at_simulated_world_sizes(world_size: int) -> None:
    model = GPT(GPTConfig(vocab_size=512, seq_len=32, n_layers=8, d_model=64, n_heads=4), device="meta")
    plan = plan_model(model, world_size, unit_prefixes=model.unit_prefixes())
    updaters: dict[str, list[int]] = {s.fqn: [] for s in plan}
    ranks = range(world_size) if world_size <= 64 else [0, 1, 2, 511, 1023]
    for rank in ranks:
        opt = OwnerRoutedOptimizer(simulated_parameters(plan, rank), matrix="muon")
        for r in opt.routes():
            if r["local"]:
                updaters[r["name"]].append(rank)
            assert r["role"] == plan[r["name"]].role.value
        owned = {s.fqn for s in plan.owned_by(rank)}
        local = {r["name"] for r in opt.routes() if r["local"]}
        sharded_here = {s.fqn for s in plan if s.role is Role.ROWS and s.local_numel(rank) > 0}
        assert local == owned | sharded_here
    if world_size <= 64:  # every rank simulated: each owned tensor updated by exactly its owner
        for s in plan:
            if s.role is Role.ROWS:
                assert updaters[s.fqn] == [r for r in range(world_size) if s.local_numel(r) > 0]
            else:
                assert updaters[s.fqn] == [s.owner]


def test_register_preconditioner_and_cost() -> None:
    class Half(torch.optim.SGD):
        pass

    register_preconditioner("half_sgd_test", Half, overwrite=True)
    assert "half_sgd_test" in available_optimizers()
    opt = OwnerRoutedOptimizer(nn.Linear(4, 4).named_parameters(), matrix="HALF_SGD_TEST", matrix_options={"lr": 0.1})
    assert isinstance(opt.matrix_optimizer, Half)
    with pytest.raises(ValueError, match="already registered"):
        register_preconditioner("half_sgd_test", torch.optim.SGD)


def test_entry_point_from_an_installed_package(tmp_path) -> None:
    pkg = tmp_path / "site"
    (pkg / "myopt").mkdir(parents=True)
    (pkg / "myopt" / "__init__.py").write_text(
        textwrap.dedent("""
        import torch
        class Signum(torch.optim.Optimizer):
            def __init__(self, params, lr=0.01):
                super().__init__(params, {"lr": lr})
            @torch.no_grad()
            def step(self, closure=None):
                for g in self.param_groups:
                    for p in g["params"]:
                        if p.grad is not None:
                            p.add_(p.grad.sign(), alpha=-g["lr"])
    """)
    )
    dist_info = pkg / "myopt-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: myopt\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[matrix_owner_optim.preconditioners]\nsignum = myopt:Signum\n")
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from matrix_owner_optim import OwnerRoutedOptimizer
        from matrix_owner_optim.optim import available_optimizers
        assert "signum" in available_optimizers(), available_optimizers()
        lin = torch.nn.Linear(3, 2, bias=False)
        torch.nn.init.zeros_(lin.weight)
        opt = OwnerRoutedOptimizer(lin.named_parameters(), matrix="signum", matrix_options={"lr": 0.5})
        lin.weight.grad = torch.tensor([[1.0, -2.0, 0.0], [3.0, 0.0, -1.0]])
        opt.step()
        print(type(opt.matrix_optimizer).__module__, lin.weight.tolist())
    """)
    out = subprocess.run([sys.executable, "-c", code, str(pkg)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "myopt [[-0.5, 0.5, 0.0], [-0.5, 0.0, 0.5]]"


@pytest.mark.parametrize("batched", [False, True])
def test_muon_from_package_matches_torch_muon_defaults(batched: bool) -> None:
    # per matrix: bitwise; batched (the default): its bfloat16 fast form rounds otherwise on a
    # CPU without bfloat16 matmuls (measured 4.5e-4 after 3 steps; bound ~9x, bf16's 2^-8 scale)
    model, ref = twin_models()
    opt = OwnerRoutedOptimizer(model, matrix="muon", matrix_options={} if batched else {"batched": False})
    assert isinstance(opt.matrix_optimizer, Muon)
    opt2 = OwnerRoutedOptimizer(ref, matrix="torch_muon")
    assert isinstance(opt2.matrix_optimizer, torch.optim.Muon)
    _train_alongside(model, opt, ref, [opt2], 3)
    assert max_param_rel_err_native(model, ref, floor=1e-12) <= (2**-8 if batched else 0.0)


def test_child_groups_read_and_write_the_parent_groups() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = OwnerRoutedOptimizer(model.named_parameters(), matrix_options={"lr": 0.02})
    parent, child = opt.param_groups[0], opt.matrix_optimizer.param_groups[0]
    assert child["params"] is not parent["params"]  # its own list: this rank's proxies
    assert "param_names" in parent and "param_names" not in child and "role" not in child and "optimizer" not in child
    parent["lr"] = 0.5  # a scheduler's write: the child reads it, nothing is copied
    assert child["lr"] == 0.5 and child.get("lr") == 0.5 and dict(child)["lr"] == 0.5
    child["d"] = 3.0  # a value the child sets itself (Prodigy's d): in the parent at once
    assert parent["d"] == 3.0 and "d" in child
    assert opt.state_dict()["param_groups"][0]["d"] == 3.0
    assert type(dict(child)) is dict and set(child) == (set(parent) - {"param_names", "role", "optimizer"})


def test_state_is_the_childrens_own() -> None:
    """``opt.state[p]`` is the child's state of ``p``'s proxy, read where the child keeps it:
    empty before the first step (as torch's, for DSD), the same dict object after it (nothing is
    copied or re-linked per step), a conv kernel's under its 2D view, and a write or a delete
    through ``opt.state`` lands in the child."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(16, 2))
    opt = OwnerRoutedOptimizer(model, roles={"0.weight": "matrix"})
    assert not opt.state and len(opt.state) == 0 and list(opt.state) == []
    for _ in range(2):
        model(torch.randn(3, 2, 4, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    conv, lin = model[0].weight, model[2].weight
    muon = opt.matrix_optimizer
    assert muon is not None and opt.tail_optimizer is not None
    (view,) = [p for p in muon.state if p.shape == (4, 18)]  # the conv kernel's (out, rest) view
    assert opt.state[conv] is muon.state[view] and opt.state[lin] is muon.state[lin]
    assert opt.state[model[2].bias] is opt.tail_optimizer.state[model[2].bias]
    assert set(map(id, opt.state)) == {id(p) for p in model.parameters()}
    fresh = {"momentum_buffer": torch.zeros(2, 16)}
    opt.state[lin] = fresh
    assert muon.state[lin] is fresh
    del opt.state[lin]
    assert lin not in muon.state and lin not in opt.state and len(opt.state) == 3
    with pytest.raises(KeyError):
        opt.state[torch.zeros(1)]  # not a parameter of this optimizer


def test_load_keeps_live_values_a_saved_group_lacks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = OwnerRoutedOptimizer(model.named_parameters())
    sd = copy.deepcopy(opt.state_dict())
    assert [g["role"] for g in sd["param_groups"]] == ["matrix", "tail"]
    for g in sd["param_groups"]:
        del g["role"], g["optimizer"]  # saved before the groups recorded them
    del sd["param_groups"][1]["eps"]  # saved before the tail optimizer had this hyperparameter
    opt.load_state_dict(sd)
    assert opt.param_groups[1]["eps"] == 1e-8 and opt.param_groups[1]["role"] == "tail"
    assert opt.param_groups[1]["optimizer"] == "tail"
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()  # the child still reads every hyperparameter it needs
