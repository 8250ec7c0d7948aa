"""Notebooks run top to bottom on simulated devices (in a fresh kernel)."""
import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


EXPECTED = {
    "01_meshes_and_strategies.ipynb": ["reduce-scatter", "all-gather", "no rule fits logical name 'mlp'"],
    "02_pipelines.ipynb": ["collective-permute | pipe", "1f1b          16   0.158     38               4"],
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_notebook_executes(name, tmp_path):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    env_before = os.environ.get("XLA_FLAGS")
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    for text in EXPECTED[name]:
        assert text in outputs, text
    if name == "02_pipelines.ipynb":   # the pipelined losses equal the single-device ones
        diff = float(outputs.split("max relative difference:")[1].split()[0])
        assert diff < 1e-5
    assert os.environ.get("XLA_FLAGS") == env_before
