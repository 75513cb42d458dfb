"""The model suite: four small PyTorch models built in code, for the importer and ``rdakit bench
models`` (docs/import.md, "The model suite").

Plain ``torch.nn`` modules written after the architectures users bring first, with random
weights from a fixed seed (no download, no transformers or torchvision dependency):

``gpt2``
    A GPT-2 style decoder: token embedding and learned positions, pre-norm blocks (LayerNorm,
    causal self-attention with one fused QKV projection, a GELU MLP with GPT-2's tanh
    approximation), a final LayerNorm and an LM head tied to the token embedding. Output: the
    logits, ``(batch, tokens, vocab)``.
``bert``
    A BERT style encoder: word, position and token-type embeddings with LayerNorm, post-norm
    blocks (self-attention with separate Q, K and V projections, no mask; an exact-GELU MLP).
    Output: the last hidden states, ``(batch, tokens, d_model)``.
``mixtral``
    A Mixtral style decoder: RMSNorm, rotary position embeddings on Q and K, grouped-query
    attention (``kv_heads`` key/value heads repeated for the query heads), causal, and a sparse
    mixture of SwiGLU experts: the router's softmax, top-``k`` experts a token, their gates
    renormalised to sum to 1, and each expert run on the tokens routed to it only
    (``torch.where`` on the routing mask, ``index_add_`` to combine) as the reference Mixtral
    implementation does, so the exported graph has data-dependent sizes. Output: the logits.
``resnet``
    A small ResNet of BasicBlocks on 32x32 images: a 3x3 stem with batch-norm, ReLU and a 3x3
    max-pool, one stage per width (the first block of a stage after the first strides 2, with a
    1x1 convolution and batch-norm on the shortcut), adaptive average pooling and a linear head.
    The example images are smooth random patterns; the batch-norms' running statistics are
    those of the example batch and the head's bias centres its pooled features, so that the
    classes differ from image to image as a trained classifier's do (a random network gives
    every image one class). Output: the logits, ``(batch, classes)``.

:func:`build` gives the module (in eval mode) and its example inputs, :func:`export` the
``torch.export`` program of the two; both take the model's sizes as keyword arguments
(:data:`SIZES` has the defaults, which are the issue's sizes; the tests use smaller ones) and
``seed``. The same name, sizes and seed give the same weights and inputs, bit for bit, in any
process.

This module imports torch, an optional dependency (``rdakit[torch]``): import it only where a
model is wanted.
"""

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "SIZES", "build", "export", "parameter_count"]


# --- attention ----------------------------------------------------------------------------------

class _SelfAttention(nn.Module):
    """Multi-head self-attention through ``scaled_dot_product_attention``: GPT-2's (one fused QKV
    projection, causal) or BERT's (separate Q, K and V projections, no mask)."""

    def __init__(self, d_model, heads, *, causal, fused):
        super().__init__()
        self.heads, self.causal, self.fused = heads, causal, fused
        if fused:
            self.qkv = nn.Linear(d_model, 3 * d_model)
        else:
            self.q = nn.Linear(d_model, d_model)
            self.k = nn.Linear(d_model, d_model)
            self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        if self.fused:
            q, k, v = self.qkv(x).split(d, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).contiguous().view(b, t, d))


# --- gpt2 ---------------------------------------------------------------------------------------

class _GPT2Block(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _SelfAttention(d_model, heads, causal=True, fused=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """A GPT-2 style decoder (see the module docstring)."""

    def __init__(self, *, vocab, d_model, heads, layers, positions):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(positions, d_model)
        self.blocks = nn.ModuleList(_GPT2Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight            # tied, as in GPT-2
        self.register_buffer("pos", torch.arange(positions), persistent=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(self.pos[:ids.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _gpt2(*, vocab=256, d_model=64, heads=4, layers=2, tokens=8, batch=1, seed=0):
    _check_heads(d_model, heads)
    model = GPT2(vocab=vocab, d_model=d_model, heads=heads, layers=layers, positions=tokens)
    return model, (_tokens(seed, vocab, batch, tokens),)


# --- bert ---------------------------------------------------------------------------------------

class _BertLayer(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.attn = _SelfAttention(d_model, heads, causal=False, fused=False)
        self.ln1 = nn.LayerNorm(d_model, eps=1e-12)
        self.ffn = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.ln2 = nn.LayerNorm(d_model, eps=1e-12)

    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))


class Bert(nn.Module):
    """A BERT style encoder (see the module docstring)."""

    def __init__(self, *, vocab, d_model, heads, layers, positions):
        super().__init__()
        self.word = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(positions, d_model)
        self.token_type = nn.Embedding(2, d_model)
        self.ln = nn.LayerNorm(d_model, eps=1e-12)
        self.layers = nn.ModuleList(_BertLayer(d_model, heads) for _ in range(layers))
        self.register_buffer("pos", torch.arange(positions), persistent=False)
        self.register_buffer("types", torch.zeros(positions, dtype=torch.long),
                             persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.ln(self.word(ids) + self.position(self.pos[:t]) + self.token_type(self.types[:t]))
        for layer in self.layers:
            x = layer(x)
        return x


def _bert(*, vocab=256, d_model=64, heads=4, layers=2, tokens=8, batch=2, seed=0):
    _check_heads(d_model, heads)
    model = Bert(vocab=vocab, d_model=d_model, heads=heads, layers=layers, positions=tokens)
    return model, (_tokens(seed, vocab, batch, tokens),)


# --- mixtral ------------------------------------------------------------------------------------

class _RotaryAttention(nn.Module):
    """Mixtral's attention: rotary embeddings on Q and K, ``kv_heads`` key/value heads each
    repeated for ``heads // kv_heads`` query heads, causal, no biases."""

    def __init__(self, d_model, heads, kv_heads, positions, theta=10000.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(positions).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _repeat_kv(self, x):
        b, h, t, d = x.shape
        rep = self.heads // self.kv_heads
        return x[:, :, None, :, :].expand(b, h, rep, t, d).reshape(b, h * rep, t, d)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:t], self.sin[:t]
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v),
                                           is_causal=True)
        return self.o(y.transpose(1, 2).contiguous().view(b, t, d))


class _Expert(nn.Module):
    """A SwiGLU expert: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _SparseMoE(nn.Module):
    """Mixtral's sparse mixture of experts: softmax over the router's logits, the top ``k``
    experts of each token with their gates renormalised, each expert run on its tokens only."""

    def __init__(self, d_model, d_ff, experts, k):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(_Expert(d_model, d_ff) for _ in range(experts))

    def forward(self, x):
        b, t, d = x.shape
        x = x.view(-1, d)
        gates = F.softmax(self.router(x), dim=-1)
        gates, chosen = torch.topk(gates, self.k, dim=-1)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        # (experts, k, tokens): which of a token's k choices picked each expert.
        mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, expert(x[token]) * gates[token, slot, None])
        return out.view(b, t, d)


class _MixtralBlock(nn.Module):
    def __init__(self, d_model, heads, kv_heads, d_ff, experts, k, positions):
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model, eps=1e-5)
        self.attn = _RotaryAttention(d_model, heads, kv_heads, positions)
        self.norm2 = nn.RMSNorm(d_model, eps=1e-5)
        self.moe = _SparseMoE(d_model, d_ff, experts, k)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class Mixtral(nn.Module):
    """A Mixtral style mixture-of-experts decoder (see the module docstring)."""

    def __init__(self, *, vocab, d_model, heads, kv_heads, d_ff, experts, k, layers, positions):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(
            _MixtralBlock(d_model, heads, kv_heads, d_ff, experts, k, positions)
            for _ in range(layers))
        self.norm = nn.RMSNorm(d_model, eps=1e-5)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def _mixtral(*, vocab=256, d_model=64, heads=4, kv_heads=2, d_ff=128, experts=4, k=2,
             layers=2, tokens=8, batch=1, seed=0):
    _check_heads(d_model, heads)
    if heads % kv_heads:
        raise ValueError(f"heads must be a multiple of kv_heads, not {heads} with kv_heads "
                         f"{kv_heads}")
    if (d_model // heads) % 2:
        raise ValueError(f"d_model // heads must be even (rotary embeddings turn pairs), not "
                         f"{d_model // heads}")
    if k > experts:
        raise ValueError(f"k must be at most experts ({experts}), not {k}")
    model = Mixtral(vocab=vocab, d_model=d_model, heads=heads, kv_heads=kv_heads, d_ff=d_ff,
                    experts=experts, k=k, layers=layers, positions=tokens)
    return model, (_tokens(seed, vocab, batch, tokens),)


# --- resnet -------------------------------------------------------------------------------------

class _BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    """A small ResNet of BasicBlocks (see the module docstring)."""

    def __init__(self, *, widths, blocks, classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU(),
                                  nn.MaxPool2d(3, stride=2, padding=1))
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks):
                layers.append(_BasicBlock(cin, w, 2 if i > 0 and j == 0 else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def _resnet(*, widths=(16, 32, 64), blocks=1, classes=10, image=32, batch=8, seed=0):
    widths = tuple(widths)
    if not widths:
        raise ValueError("widths must name at least one stage's channels, not ()")
    model = ResNet(widths=widths, blocks=blocks, classes=classes)
    # Images of i.i.d. noise all give a random network nearly the same pooled features (and so
    # one class for the whole batch): smooth random patterns instead, a colour per image, some
    # noise.
    g = torch.Generator().manual_seed(seed + 1)
    images = (torch.randn(batch, 3, 1, 1, generator=g)
              + F.interpolate(torch.randn(batch, 3, 4, 4, generator=g), size=image,
                              mode="bilinear", align_corners=False)
              + 0.2 * torch.randn(batch, 3, image, image, generator=g))
    # What training leaves that random initialisation does not, from the example batch: the
    # batch-norms' running statistics are the batch's (cumulative averages of one pass, so
    # folding them at import is not the identity), their affine parameters random; and the
    # head's bias centres the batch's pooled features (they are all positive after the last
    # ReLU and would otherwise pick one class for every image). The classes then differ from
    # image to image with margins of a few percent to a few tens of percent of the logits' spread,
    # so top-1 agreement against float measures what quantization cost.
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(0.1 * torch.randn(m.num_features, generator=g))
            m.momentum = None
    with torch.no_grad():
        model.train()(images)
        features = torch.flatten(model.pool(model.layers(model.stem(images))), 1)
        model.fc.bias.copy_(-model.fc.weight @ features.mean(0))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = 0.1
    return model.eval(), (images,)


# --- the suite ----------------------------------------------------------------------------------

_BUILDERS = {"gpt2": _gpt2, "bert": _bert, "mixtral": _mixtral, "resnet": _resnet}

#: The models of the suite, in table order.
MODELS = tuple(_BUILDERS)

#: Each model's sizes and their defaults (the keyword arguments of :func:`build`), ``seed``
#: included.
SIZES = {name: {p.name: p.default for p in inspect.signature(f).parameters.values()}
         for name, f in _BUILDERS.items()}


def _check_heads(d_model, heads):
    if d_model % heads:
        raise ValueError(f"d_model must be a multiple of heads, not {d_model} with heads "
                         f"{heads}")


def _tokens(seed, vocab, batch, tokens):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, (batch, tokens), generator=g)


def _check(name, sizes):
    if name not in _BUILDERS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, not {name!r}")
    for key, value in sizes.items():
        if key not in SIZES[name]:
            raise ValueError(f"{name} takes the sizes {', '.join(SIZES[name])}, not {key!r}")
        default = SIZES[name][key]
        if isinstance(default, tuple):
            ok = (isinstance(value, tuple | list) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value))
        else:
            low = 0 if key == "seed" else 1
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        if not ok:
            what = ("a tuple of positive integers" if isinstance(default, tuple)
                    else "an integer >= 0" if key == "seed" else "a positive integer")
            raise ValueError(f"{name}'s size {key} must be {what}, not {value!r}")


def build(name, **sizes):
    """The model ``name`` of :data:`MODELS` in eval mode, and its example inputs.

    Parameters
    ----------
    name : str
        ``"gpt2"``, ``"bert"``, ``"mixtral"`` or ``"resnet"``.
    **sizes
        Any of the model's sizes in :data:`SIZES` (the others keep their defaults); ``seed``
        picks the weights and the inputs.

    Returns
    -------
    (torch.nn.Module, tuple of torch.Tensor)
        The module and the positional inputs of its ``forward``.

    Raises
    ------
    ValueError
        If ``name`` is not a model of the suite, or a size is not one of its sizes or not a
        positive integer, or the sizes do not go together (``d_model`` a multiple of
        ``heads``, ...); the message names what was given.
    """
    _check(name, sizes)
    seed = sizes.get("seed", 0)
    # The weights from the seed alone, leaving the caller's random state as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, inputs = _BUILDERS[name](**sizes)
    return model.eval(), inputs


def export(name, **sizes):
    """The ``torch.export`` program of :func:`build`'s model on its example inputs (eval mode,
    no gradients), and those inputs: ``(ExportedProgram, example_inputs)``. Deterministic: the
    same arguments give the same graph, weights and inputs. Raises what :func:`build` raises.
    """
    model, inputs = build(name, **sizes)
    with torch.no_grad():
        program = torch.export.export(model, inputs)
    return program, inputs


def parameter_count(model):
    """Parameters of a module or an ``ExportedProgram`` (tied ones, such as GPT-2's head and
    token embedding, once)."""
    unique = {id(p): p for p in model.parameters()}
    return sum(math.prod(p.shape) for p in unique.values())
