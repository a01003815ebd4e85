import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the Triton-interpreter scripts (interpreter_scripts.py) now if a test that reads them will run."""
    import interpreter_scripts
    from specserve.kernels._triton import HAVE_TRITON

    if HAVE_TRITON and not session.config.option.collectonly and any(
            getattr(item, "originalname", None) in interpreter_scripts.TESTS for item in session.items):
        interpreter_scripts.start(session.config)


def pytest_sessionfinish(session):
    import interpreter_scripts

    interpreter_scripts.stop(session.config)
