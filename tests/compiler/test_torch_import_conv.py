"""Convolutions, batch norm and pooling in the torch.export importer (compiler/frontend/conv.py):
conv2d with strides, paddings, dilation and channel counts close to torch's float conv on the
dequantized input and bit-exact on the interpreter against the graph's evaluate; batch norm
folded exactly; max, average and adaptive pooling; images cut into groups computing the same
graph; bad parameters refused naming the node; the suite's ResNet: its tensors fit an MU, and
it compiles with --fabric auto."""

import argparse
import math

import numpy as np
import pytest
from conftest import assert_interpreter_matches

from rdakit.compiler.frontend import conv
from rdakit.compiler.frontend.importer import ModelImportError, import_program

torch = pytest.importorskip("torch")

from rdakit.cli import main  # noqa: E402
from rdakit.cli.compile import choose_fabric  # noqa: E402
from rdakit.cli.options import RUN_PROG_LEN, add_fabric_arguments, fabric_candidates  # noqa: E402
from rdakit.compiler.compile import compile_workload  # noqa: E402
from rdakit.hdl.spec.params import fabric_params  # noqa: E402

P4 = fabric_params(4, 4, prog_len=4096, mu_words=32768, max_buffers=64)


def _fabric_args():
    parser = argparse.ArgumentParser()
    add_fabric_arguments(parser, auto=True, check=False)
    parser.set_defaults(prog_len=RUN_PROG_LEN)
    return parser.parse_args([])


#: The fabric options of bench models left at their defaults (--fabric auto).
FABRIC_ARGS = _fabric_args()

#: (in channels, out channels, kernel, stride, padding, dilation) of each conv of the zoo.
CONVS = [(3, 4, 3, 1, 1, 1), (3, 6, 3, 2, 1, 1), (3, 5, 1, 2, 0, 1), (3, 8, 3, 1, 0, 1),
         (3, 4, 3, 1, 2, 2), (3, 16, 1, 1, 0, 1)]


class Zoo(torch.nn.Module):
    """Every conv of CONVS on one image batch, then pooling of the first one's ReLU."""

    def __init__(self):
        super().__init__()
        self.convs = torch.nn.ModuleList(
            torch.nn.Conv2d(ci, co, k, stride=s, padding=p, dilation=d, bias=i % 2 == 0)
            for i, (ci, co, k, s, p, d) in enumerate(CONVS))
        self.bn = torch.nn.BatchNorm2d(4)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(-1.5, 1.5)

    def forward(self, x):
        ys = [c(x) for c in self.convs]
        r = torch.relu(ys[0])
        out = (*ys, self.bn(r),
               torch.nn.functional.max_pool2d(r, 3, 2, 1),
               torch.nn.functional.avg_pool2d(r, 2),
               torch.nn.functional.avg_pool2d(r, 3, 1, 1, count_include_pad=False),
               torch.nn.functional.adaptive_avg_pool2d(r, 1),
               torch.nn.functional.adaptive_avg_pool2d(r, 2))
        # NHWC outputs: the IR tensors as they are (an NCHW output would be copied row by row).
        return tuple(o.permute(0, 2, 3, 1) for o in out)


class ConvBN(torch.nn.Module):
    def __init__(self, bn=True):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8) if bn else torch.nn.Identity()
        if bn:
            with torch.no_grad():
                self.bn.running_mean.uniform_(-0.3, 0.3)
                self.bn.running_var.uniform_(0.2, 3.0)
                self.bn.weight.uniform_(-2, 2)
                self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def _export(module, x):
    return torch.export.export(module.eval(), (x,))


@pytest.fixture(scope="module")
def zoo():
    torch.manual_seed(0)
    module = Zoo().eval()
    x = torch.randn(2, 3, 8, 8)
    return module, x, import_program(_export(module, x), name="zoo")


def test_zoo_imports_every_op(zoo):
    _, _, model = zoo
    assert all(c["supported"] for c in model.coverage.values())
    assert {"aten.convolution.default", "aten.max_pool2d_with_indices.default",
            "aten.avg_pool2d.default"} <= set(model.coverage)


def test_convolutions_are_close_to_torch_on_the_dequantized_input(zoo):
    module, x, model = zoo
    (name,) = model.inputs
    q = model.inputs[name].reshape(x.shape)                 # the NCHW bytes, (N * C, H * W)
    xq = torch.tensor(q * model.input_scales[name], dtype=torch.float32)
    got = model.dequantize(model.evaluate())
    for i, c in enumerate(module.convs):
        want = c(xq).permute(0, 2, 3, 1).detach().numpy().astype(np.float64)
        y = got["y" + str(i)]
        cosine = float((want * y).sum() / np.linalg.norm(want) / np.linalg.norm(y))
        assert cosine >= 0.99, (CONVS[i], cosine)


def test_every_output_is_close_to_float(zoo):
    _, _, model = zoo
    for o in model.accuracy.outputs:
        assert o.cosine >= 0.99, o


# 6 s (22 s before the taps were separable): the zoo compiled for 4x4, interpreted
@pytest.mark.slow
def test_interpreter_is_bit_exact_against_the_graph(zoo):
    _, _, model = zoo
    job = compile_workload(model.workload(), params=P4, place_steps=200)[0]
    assert_interpreter_matches(job, model.evaluate())


def test_image_input_is_its_nchw_bytes_and_taps_are_row_shifts(zoo):
    _, x, model = zoo
    (name,) = model.inputs
    assert model.inputs[name].shape == (2 * 3, 8 * 8)
    kinds = {}
    for n in model.graph.order():
        kinds[model.graph.kind(n)] = kinds.get(model.graph.kind(n), 0) + 1
    # Per conv one matmul per kernel row (its horizontal taps concatenated), the selections in
    # bands of output rows, nothing per row. 295 ops measured (464 with every tap shifted and
    # masked on its own); a per-row copy of any 8x8 activation would add hundreds.
    assert len(model.graph) < 350, kinds


@pytest.mark.parametrize("hw, stride", [(2, 1), (2, 2), (1, 1), (4, 2)])
def test_small_images_whose_taps_share_a_shift(hw, stride):
    # On a 2-wide image the taps (-1, +1) and (0, -1) are both a shift of -1 row with
    # different masks: each tap has its own.
    torch.manual_seed(0)
    module = torch.nn.Conv2d(4, 8, 3, stride=stride, padding=1)
    model = import_program(_export(module, torch.randn(2, 4, hw, hw)))
    assert model.accuracy.cosine >= 0.99


def test_batch_norm_folds_exactly_in_float():
    torch.manual_seed(4)
    module = ConvBN().eval().double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    bn = module.bn
    scale = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach().numpy()
    shift = (bn.bias - bn.running_mean * bn.weight / torch.sqrt(bn.running_var + bn.eps)
             ).detach().numpy()
    w, b = conv.fold_batch_norm(module.conv.weight.detach().numpy(),
                                module.conv.bias.detach().numpy(), scale, shift)
    folded = torch.nn.functional.conv2d(x, torch.tensor(w), torch.tensor(b), padding=1)
    want = bn(module.conv(x))
    assert float((folded - want).abs().max().detach()) < 1e-5


def test_batch_norm_after_a_conv_costs_no_op():
    torch.manual_seed(5)
    x = torch.randn(1, 3, 6, 6)
    with_bn = import_program(_export(ConvBN(True), x))
    without = import_program(_export(ConvBN(False), x))
    assert len(with_bn.graph) == len(without.graph)
    assert with_bn.accuracy.cosine >= 0.99


@pytest.mark.parametrize("make, message", [
    (lambda: torch.nn.Conv2d(4, 4, 3, groups=2),
     r"node convolution \(aten.convolution.default\): groups=2 is not supported"),
    (lambda: torch.nn.Conv2d(4, 4, 3, padding=2),
     r"node convolution \(aten.convolution.default\): the convolution's padding \[2, 2\] is "
     r"more than half the kernel's span"),
    (lambda: torch.nn.MaxPool2d(2, ceil_mode=True),
     r"node max_pool2d_with_indices \(aten.max_pool2d_with_indices.default\): ceil_mode=True "
     r"is not supported"),
    (lambda: torch.nn.ConvTranspose2d(4, 4, 3),
     r"unsupported op kinds|transposed convolutions are not supported"),
])
def test_bad_parameters_are_refused_naming_the_node(make, message):
    torch.manual_seed(6)
    with pytest.raises(ModelImportError, match=message):
        import_program(_export(make(), torch.randn(1, 4, 6, 6)))


def test_cli_refuses_a_bad_convolution_with_exit_2(tmp_path, capsys):
    path = tmp_path / "grouped.pt2"
    torch.export.save(_export(torch.nn.Conv2d(4, 4, 3, groups=4), torch.randn(1, 4, 6, 6)),
                      str(path))
    assert main(["import", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"'{path}': node convolution (aten.convolution.default): groups=4 is not " \
           "supported (only groups=1)" in err
    assert "Traceback" not in err


class Pools(torch.nn.Module):
    """A strided conv, a residual add, every pooling: each op of conv.py that works group by
    group."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.conv2 = torch.nn.Conv2d(6, 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6)
        with torch.no_grad():
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        y = torch.relu(y + self.bn(self.conv2(y)))
        out = (y, torch.nn.functional.max_pool2d(y, 3, 2, 1),
               torch.nn.functional.avg_pool2d(y, 3, 1, 1, count_include_pad=False),
               torch.nn.functional.adaptive_avg_pool2d(y, 1), torch.amax(y, (2, 3)))
        return tuple(o.permute(0, 2, 3, 1) if o.ndim == 4 else o for o in out)


@pytest.mark.parametrize("hw", [8, 7])
def test_groups_of_images_compute_the_same_graph(monkeypatch, hw):
    # Batch 3: one group (the default), groups of 2 and 1 images (masks at the images' top
    # and bottom edges), one image a group (the fill does it). On 7x7 images a stride-2
    # output row does not stay in step across images (4 * 2 != 7): selected image by image.
    torch.manual_seed(7)
    module = Pools().eval()
    x = torch.randn(3, 3, hw, hw)
    outs = {}
    for rows in (conv.GROUP_ROWS, 2 * hw * hw, hw * hw):
        monkeypatch.setattr(conv, "GROUP_ROWS", rows)
        model = import_program(_export(module, x), name="pools")
        outs[rows] = model.evaluate()
        assert model.accuracy.cosine >= 0.99, (rows, model.accuracy.lines())
    first = outs.pop(conv.GROUP_ROWS)
    for rows, got in outs.items():
        for k in first:
            np.testing.assert_array_equal(got[k], first[k], err_msg=f"{rows}: {k}")


@pytest.fixture(scope="module")
def resnet():
    from rdakit.compiler.frontend import models
    program, inputs = models.export("resnet")
    return import_program(program, inputs, name="resnet")


def test_suite_resnet_imports_and_agrees_with_float(resnet):
    """The suite's ResNet at its size: every op supported, top-1 agreement with float."""
    assert all(c["supported"] for c in resnet.coverage.values())
    assert resnet.accuracy.top1 >= 0.95


def test_suite_resnet_tensors_fit_an_mu(resnet):
    """No tensor of the suite's ResNet needs more than 24,576 vector words (4 lanes), 3/8 of
    the largest MU --fabric auto tries (65,536): the images in groups of 2,048 positions, the
    selections in bands. Before, the stem's taps concatenated were 57,344 words, layer 1's
    73,728 and the max-pool's selection constant 65,536."""
    g = resnet.graph
    words = {n: math.prod(g.type_of(n).shape[:-1]) * -(-g.type_of(n).shape[-1] // 4)
             for n in g.order()}
    worst = max(words, key=words.get)
    assert words[worst] <= 24576, (worst, words[worst])
    assert len(g) < 700                         # 630 measured


def test_suite_resnet_compiles_for_4x4(resnet):
    """The suite's ResNet compiles for 4x4 with 32,768-word MUs (65,536 before its biases were
    stored once) and 4,096-word programs (2 s). Before the lowering received an op's inputs
    before ALLOCating its output where the MU was full, a CU counted the buffers others had
    freed as live, and no fabric --fabric auto tries held it."""
    job = compile_workload(resnet.workload(), params=fabric_params(
        4, 4, mu_words=32768, prog_len=4096), partitioner="auto")[0]
    assert 2048 < max(p.instructions for p in job.programs.values()) <= 4096


@pytest.mark.slow   # 11 s: every smaller fabric at 2,048-word programs refused first
def test_suite_resnet_compiles_with_fabric_auto(resnet):
    """--fabric auto picks that fabric, the program length with it."""
    kw, _ = compile_auto(resnet.workload())
    assert (kw["rows"], kw["cols"], kw["mu_words"], kw["prog_len"]) == (4, 4, 32768, 4096)


def compile_auto(workload):
    """The fabric bench models picks for ``workload`` (--fabric auto, the auto partitioner,
    CU programs of RUN_PROG_LEN), the job compiled for it."""
    kw, _ = choose_fabric(workload, fabric_candidates(FABRIC_ARGS), name=workload.name,
                          partitioner="auto", seed=0, place_steps=20000)
    return kw, compile_workload(workload, params=fabric_params(**kw), partitioner="auto")[0]


def test_small_resnet_runs_bit_exact_on_the_interpreter():
    """The suite's ResNet at 8x8 images, batch 2, widths 4/8/8: compiled for the fabric
    --fabric auto picks (2x3 with 2,048-word MUs; 3x3 with 4,096 before the taps were
    separable) and interpreted bit-exact against its graph."""
    from rdakit.compiler.frontend import models
    program, inputs = models.export("resnet", image=8, batch=2, widths=(4, 8, 8))
    model = import_program(program, inputs, name="resnet_small")
    assert all(c["supported"] for c in model.coverage.values())
    kw, job = compile_auto(model.workload())
    assert kw["rows"] * kw["cols"] <= 6 and kw["mu_words"] <= 2048, kw
    assert_interpreter_matches(job, model.evaluate())
