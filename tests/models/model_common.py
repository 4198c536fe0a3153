"""What the tests of tests/models share: the rule for a missing model."""
import os
import sys


def require_model(name="smollm2"):
    """Exits 77 (SKIPPED, with the install command) when the package that
    ships the model is absent; under CI=true fails instead, since CI must run
    the model's tests."""
    from kvrelay import models
    try:
        models.gguf_path(name)
    except models.ModelNotInstalled as e:
        if os.environ.get("CI") == "true":
            sys.exit(f"FAIL: under CI=true the model must be installed: {e}")
        print(f"SKIPPED: {e}", flush=True)
        sys.exit(77)
