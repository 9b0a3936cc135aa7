"""Training loops as users write them, under a fractional budget that moves tensors, against
PyTorch alone bit for bit: tied weights, BatchNorm's running statistics, gradient accumulation,
``clip_grad_norm_``, ``zero_grad`` with and without ``set_to_none``, an LR scheduler, parameter
groups, fused and foreach optimizers, bf16 autocast."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import dynn_runtime as dr
from dynn_runtime.errors import ConfigError
from dynn_runtime.runtime.events import native_module

SOURCES = ["python", "native"] if native_module() is not None else ["python"]


def _train(model: nn.Module, optimizers: list, budget, events: str, steps: int, one_step, *, device: str = "cpu",
           between=None, extra: tuple[nn.Module, ...] = (), inspect=None, **options):
    """Train ``model`` for ``steps`` steps, each ``one_step(step)`` (returning its losses) followed by
    ``between(step)`` outside it, under a manager with ``budget`` (lru) or alone (None);
    ``inspect(mm)`` runs before the manager detaches. Returns the losses, the state after
    (``model``'s and ``extra``'s, every optimizer's) and the evictions."""
    mm = None
    if budget is not None:
        mm = dr.MemoryManager(budget, policy="lru", device=device, events=events, **options)
        mm.attach(model, optimizers)
    losses: list[float] = []
    try:
        for step in range(steps):
            with mm.step() if mm is not None else contextlib.nullcontext():
                out = one_step(step)
            losses += [x.item() for x in out]
            if between is not None:
                between(step)
        if inspect is not None and mm is not None:
            inspect(mm)
        moved = mm.stats()["evictions"] if mm is not None else 0
    finally:
        if mm is not None:
            mm.detach()
    state = [t.clone() for m in (model, *extra) for t in m.state_dict().values()]
    state += [v.clone() for opt in optimizers for s in opt.state.values() for v in s.values()
              if isinstance(v, torch.Tensor)]
    return losses, state, moved


def _assert_same_bits(managed, alone) -> None:
    losses, state, moved = managed
    assert moved > 0, "nothing moved: the budget must be below the peak"
    assert losses == alone[0]
    assert len(state) == len(alone[1])
    assert all(torch.equal(a, b) for a, b in zip(state, alone[1], strict=True))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.bn = nn.BatchNorm1d(64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64)) for _ in range(4))
        self.head = nn.Linear(64, 100, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor, depth: int) -> torch.Tensor:
        h = self.bn(self.emb(idx).transpose(1, 2)).transpose(1, 2)
        for block in self.blocks[:depth]:  # dynamic depth
            h = h + block(h)
        return self.head(h)


OPTIMIZERS = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    "adam-fused": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, fused=True),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
    "adamw-groups": lambda m: torch.optim.AdamW([
        {"params": m.blocks.parameters(), "lr": 1e-3},
        {"params": [*m.emb.parameters(), *m.bn.parameters()], "lr": 1e-4, "weight_decay": 0.0}]),
}


def _users_loop(opt_name: str, budget, events: str, amp: bool, device: str = "cpu"):
    torch.manual_seed(0)
    model = _Net().to(device)
    opt = OPTIMIZERS[opt_name](model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    accum = 2

    def one_step(step):
        g = torch.Generator().manual_seed(step)
        losses = []
        for k in range(accum):
            idx = torch.randint(0, 100, (16, 12), generator=g).to(device)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
                out = model(idx, 1 + (step + k) % 4)
                loss = nn.functional.cross_entropy(out.float().reshape(-1, 100), idx.reshape(-1)) / accum
            loss.backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        return losses

    return _train(model, [opt], budget, events, 5, one_step, device=device, between=lambda step: sched.step())


@pytest.mark.parametrize("events", SOURCES)
@pytest.mark.parametrize("opt_name,amp", [(n, False) for n in OPTIMIZERS] + [("adam", True), ("sgd", True)])
def test_a_users_training_loop_keeps_its_bits_under_a_budget_that_moves(opt_name, amp, events):
    _assert_same_bits(_users_loop(opt_name, 0.3, events, amp), _users_loop(opt_name, None, events, amp))


@pytest.mark.gpu
@pytest.mark.parametrize("events", SOURCES)
@pytest.mark.parametrize("opt_name,amp", [("adam", False), ("adam-fused", True), ("sgd", True)])
def test_a_users_training_loop_keeps_its_bits_on_cuda(opt_name, amp, events):
    from dynn_runtime.runtime.train import deterministic

    with deterministic():  # both sides: the embedding's backward and cuBLAS reproduce themselves only so
        alone = _users_loop(opt_name, None, events, amp, device="cuda")
        managed = _users_loop(opt_name, 0.3, events, amp, device="cuda")
    _assert_same_bits(managed, alone)


@pytest.mark.parametrize("events", SOURCES)
def test_batch_norms_running_statistics_written_in_place_survive_the_next_eviction(events):
    # native_batch_norm updates running_mean and running_var in place without its schema saying
    # so: the host copy the first offload made is stale after the forward, and the second offload
    # must copy again rather than keep it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
    ref = copy.deepcopy(model)
    bn = model[1]
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu", events=events).attach(model)
    try:
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            assert mm.offload(bn.running_mean, bn.running_var) > 0
            with mm.step():
                model(x).sum().backward()  # fetches them back and updates them
            ref(x).sum().backward()
        assert mm.offload(bn.running_mean, bn.running_var) > 0
        assert torch.equal(bn.running_mean, ref[1].running_mean)
        assert torch.equal(bn.running_var, ref[1].running_var)
    finally:
        mm.detach()


class _ConvWithSparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1, groups=4), nn.BatchNorm2d(64), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
        self.emb = nn.Embedding(1000, 32, sparse=True)  # a sparse gradient, and SparseAdam's sparse updates

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.features(x) + self.emb(ids).sum(1)[:, :10]


def _conv_loop(budget, events: str):
    torch.manual_seed(0)
    model = _ConvWithSparseEmbedding().to(memory_format=torch.channels_last)
    dense = [p for n, p in model.named_parameters() if not n.startswith("emb")]
    opt = torch.optim.SGD(dense, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    sparse_opt = torch.optim.SparseAdam(model.emb.parameters(), lr=1e-2)

    def one_step(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 3, 32, 32, generator=g).to(memory_format=torch.channels_last)
        ids = torch.randint(0, 1000, (16, 5), generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x, ids), y)
        loss.backward()
        for o in (opt, sparse_opt):
            o.step()
            o.zero_grad()
        return [loss.detach()]

    return _train(model, [opt, sparse_opt], budget, events, 5, one_step)


@pytest.mark.parametrize("events", SOURCES)
def test_sparse_gradients_and_a_channels_last_cnn_keep_their_bits(events):
    # a sparse tensor's kernels read its indices and values, which the manager may have moved: each
    # is faulted back as an input of the operator that reads the sparse tensor
    _assert_same_bits(_conv_loop(0.6, events), _conv_loop(None, events))


@pytest.mark.parametrize("events", SOURCES)
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_an_operator_on_a_sparse_tensor_brings_its_moved_parts_back(events, layout):
    model = nn.Linear(4, 4)
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu", events=events).attach(model)
    try:
        with mm.step():
            dense = torch.randn(16, 16) * (torch.rand(16, 16) > 0.7)
            sp = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
            parts = [sp._indices(), sp._values()] if layout == "coo" else [sp.crow_indices(), sp.col_indices(),
                                                                           sp.values()]
            assert mm.offload(*parts) > 0  # the sparse tensor's own storages leave the device
            assert torch.equal(sp.to_dense(), dense)  # its operator has them as inputs: fetched first
            assert torch.equal((sp * 2).to_dense(), dense * 2)
    finally:
        mm.detach()


class _WithHooksAndTarget(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.utils.parametrizations.weight_norm(nn.Linear(32, 128))
        self.b = nn.Linear(128, 128)
        self.c = nn.Linear(128, 8)
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.register_buffer("ema", torch.zeros(128))
        self.b.weight.register_hook(lambda g: g * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.relu(self.a(self.frozen(x)), inplace=True)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)  # a buffer updated in the forward
        return self.c(nn.functional.relu_(self.b(h)))


@pytest.mark.filterwarnings("ignore:dynn-runtime. the state does not fit")  # (state_dict's CPU copies)
@pytest.mark.parametrize("events", SOURCES)
def test_parametrizations_gradient_hooks_data_clipping_and_a_target_network_keep_their_bits(events):
    def loop(budget):
        torch.manual_seed(0)
        online = _WithHooksAndTarget()
        target = copy.deepcopy(online)  # not attached: a DQN-style target network, synced between steps
        opt = torch.optim.RMSprop([p for p in online.parameters() if p.requires_grad], lr=1e-3)

        def one_step(step):
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
            with torch.no_grad():
                y = target(x) + 1
            loss = nn.functional.mse_loss(online(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            for p in online.c.parameters():
                p.data.clamp_(-0.05, 0.05)  # WGAN-style clipping through .data
            return [loss.detach()]

        def sync(step):
            if step % 3 == 2:
                target.load_state_dict(online.state_dict())

        return _train(online, [opt], budget, events, 8, one_step, between=sync, extra=(target,))

    _assert_same_bits(loop(0.6), loop(None))


def _gradient_penalty(m: nn.ModuleDict, x: torch.Tensor, step: int) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    out = m["critic"](x)
    grad = torch.autograd.grad(out.sum(), x, create_graph=True)[0]  # a double backward (WGAN-GP)
    return out.mean() + 10 * (grad.norm(2, dim=1) - 1).pow(2).mean()


def _retained(m: nn.ModuleDict, x: torch.Tensor, step: int) -> torch.Tensor:
    out = m["critic"](x)
    out.mean().backward(retain_graph=True)  # the graph's saved tensors are read by two backwards
    return out.pow(2).mean()


def _policy_gradient(m: nn.ModuleDict, x: torch.Tensor, step: int) -> torch.Tensor:
    d = torch.distributions.Categorical(logits=m["critic"](x))
    a = d.sample()
    return -(d.log_prob(a) * torch.randn(a.shape[0])).mean() - 0.01 * d.entropy().mean()


def _spectral(m: nn.ModuleDict, x: torch.Tensor, step: int) -> torch.Tensor:
    h = m["critic"][0](x)
    f = torch.fft.rfft(h, dim=-1) * torch.view_as_complex(m["spectrum"].weight.view(-1, 2))[:129]
    return torch.fft.irfft(f, n=h.shape[-1], dim=-1).pow(2).mean()


def _padded_transformer(m: nn.ModuleDict, x: torch.Tensor, step: int) -> torch.Tensor:
    src = x.view(x.shape[0], 8, 16)
    mask = torch.zeros(x.shape[0], 8, dtype=torch.bool)
    mask[:, 6 - step % 3:] = True
    return m["encoder"](src, src_key_padding_mask=mask).pow(2).mean()


def _per_sample_gradients(m: nn.ModuleDict, x: torch.Tensor, step: int) -> torch.Tensor:
    from torch.func import functional_call, grad, vmap

    lin = m["critic"][0]
    params = dict(lin.named_parameters())
    g = vmap(grad(lambda p, xi: functional_call(lin, p, (xi[None],)).pow(2).sum()), in_dims=(None, 0))(params, x)
    return lin(x).pow(2).mean() + 1e-3 * torch.stack([v.flatten(1).norm(dim=1) for v in g.values()]).sum(0).mean()


LOSSES = {"gradient-penalty": _gradient_penalty, "retain-graph": _retained, "policy-gradient": _policy_gradient,
          "fft": _spectral, "padded-transformer": _padded_transformer, "per-sample-gradients": _per_sample_gradients}


def _loss_loop(kind: str, budget, events: str):
    torch.manual_seed(0)
    m = nn.ModuleDict({
        "critic": nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10)),
        "encoder": nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 64, dropout=0.0, batch_first=True), 2,
                                         enable_nested_tensor=False),
        "spectrum": nn.Linear(258, 1, bias=False)})
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)

    def one_step(step):
        x = torch.randn(32, 128, generator=torch.Generator().manual_seed(step))
        torch.manual_seed(100 + step)  # what the loss samples
        loss = LOSSES[kind](m, x, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return [loss.detach()]

    return _train(m, [opt], budget, events, 5, one_step, measure_steps=2)


@pytest.mark.parametrize("events", SOURCES)
@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_double_backward_retained_graphs_sampling_fft_masks_and_torch_func_keep_their_bits(kind, events):
    if kind == "per-sample-gradients" and events == "python":
        pytest.skip("torch.func's grad refuses saved-tensor hooks, which the Python event source always sets")
    budget = 0.75 if kind == "per-sample-gradients" else 0.4
    _assert_same_bits(_loss_loop(kind, budget, events), _loss_loop(kind, None, events))


@pytest.mark.parametrize("events", SOURCES)
def test_a_gan_with_both_optimizers_attached_keeps_its_bits_and_moves_both_states(events):
    kinds: set[str] = set()

    def loop(budget):
        torch.manual_seed(0)
        gen = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))
        disc = nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 128), nn.LeakyReLU(0.2),
                             nn.Linear(128, 1))
        opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
        bce = nn.functional.binary_cross_entropy_with_logits

        def one_step(step):
            g = torch.Generator().manual_seed(step)
            real, z = torch.randn(64, 64, generator=g), torch.randn(64, 16, generator=g)
            fake = gen(z)
            loss_d = bce(disc(real), torch.ones(64, 1)) + bce(disc(fake.detach()), torch.zeros(64, 1))
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = bce(disc(fake), torch.ones(64, 1))
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
            return [loss_d.detach(), loss_g.detach()]

        def inspect(mm):
            kinds.update(mm.st[mm._sid(v)].kind for opt in (opt_g, opt_d) for s in opt.state.values()
                         for k, v in s.items() if k != "step" and mm._sid(v) is not None)

        return _train(nn.ModuleDict({"gen": gen, "disc": disc}), [opt_g, opt_d], budget, events, 6, one_step,
                      inspect=inspect)

    _assert_same_bits(loop(0.3), loop(None))
    assert kinds == {"opt_state"}  # the discriminator's moments too: movable, not the program's own


def test_attach_refuses_what_is_not_an_optimizer_and_one_given_twice():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad, match in ((["sgd"], "must be a torch.optim.Optimizer"), ([opt, opt], "same optimizer twice")):
        mm = dr.MemoryManager(1 << 30, device="cpu", events="python")
        with pytest.raises(ConfigError, match=match):
            mm.attach(model, bad)
        assert not mm.attached


@pytest.mark.parametrize("events", SOURCES)
def test_activations_kept_past_a_step_that_crowd_the_budget_are_named_in_the_error(events):
    # what the program still holds when a step ends is its own from then on (never moved): an
    # early-exit loop that keeps every exit's output into the next step runs out at that step's
    # start, and the error says which bytes to free rather than to switch from lru
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)])
    mm = dr.MemoryManager(0.3, policy="lru", device="cpu", events=events).attach(model)
    kept: list[torch.Tensor] = []
    try:
        with pytest.raises(dr.BudgetError) as info:
            for step in range(3):
                x = torch.randn(128, 256, generator=torch.Generator().manual_seed(step))
                with mm.step(), torch.no_grad():
                    kept = []
                    h = x
                    for layer in model:
                        h = layer(h)
                        kept.append(h)  # every exit's output, still held when the next step starts
        message = str(info.value)
        assert "free what the program keeps from one step to the next" in message
        assert "use a policy that moves tensors" not in message
    finally:
        kept.clear()
        mm.detach()
