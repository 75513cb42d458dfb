"""Per-channel constants are stored once: a convolution's or a linear layer's bias (and any
requantization term whose rows are all the same) is a one-row constant the IR's add broadcasts
over the rows, not the full ``(rows, C_out)`` tensor; the graph computes the same values and
the interpreter runs it bit-exact."""

import numpy as np
import pytest
from conftest import assert_interpreter_matches

torch = pytest.importorskip("torch")

from rdakit.compiler.compile import compile_workload  # noqa: E402
from rdakit.compiler.frontend.importer import import_program  # noqa: E402
from rdakit.hdl.spec.params import fabric_params  # noqa: E402


class ConvLinear(torch.nn.Module):
    """A convolution with a bias and batch norm folded in, then a linear layer with a bias."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6)
        self.fc = torch.nn.Linear(6, 5)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.3, 0.3)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.bias.uniform_(-1, 1)
            self.fc.bias.uniform_(-1, 1)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x))).permute(0, 2, 3, 1)    # (N, H, W, C)
        return self.fc(y)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    module = ConvLinear().eval()
    x = torch.randn(2, 3, 4, 4)
    return import_program(torch.export.export(module, (x,)), name="convlinear")


def constants(model):
    g = model.graph
    return {n: np.asarray(g.nx.nodes[n]["attrs"]["value"]) for n in g.order()
            if g.kind(n) == "const"}


def test_no_requantization_term_repeats_its_rows(model):
    repeated = [(n, v.shape) for n, v in constants(model).items() if n.endswith(("_c", "_m"))
                and v.ndim == 2 and v.shape[0] > 1 and (v == v[:1]).all()]
    assert not repeated
    # The conv's bias (rounding term folded in) and the linear's: one row of C_out each.
    rows = {v.shape for n, v in constants(model).items() if n.endswith("_c")}
    assert rows == {(1, 6), (1, 5)}


def test_one_row_biases_run_bit_exact(model):
    assert model.accuracy.cosine >= 0.99
    job = compile_workload(model.workload(), params=fabric_params(2, 2, prog_len=2048),
                           place_steps=200)[0]
    assert_interpreter_matches(job, model.evaluate())
