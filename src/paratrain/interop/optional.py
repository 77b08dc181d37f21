"""Optional dependencies: a one-line error naming the extra to install, instead of an ImportError trace."""

from __future__ import annotations

import importlib

from paratrain.errors import UserError

EXTRA_OF = {"safetensors": "hf", "transformers": "hf", "tokenizers": "hf", "datasets": "data"}


def require(module: str, feature: str):
    """Import `module` or raise UserError: '<feature> needs the optional 'hf' extra: pip install ...'."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        extra = EXTRA_OF.get(package, package)
        raise UserError(f"{feature} needs the optional {extra!r} extra ({package} is not installed): "
                        f"pip install 'paratrain[{extra}]'") from None
