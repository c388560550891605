"""Talking to the model hub: whether it is switched off, and its failures as one-line
``ValueError``s (the CLI's exit 2, the server's start-up message), shared by the repository
snapshots (``loader.py``) and the GGUF files chosen by quantization (``hub_gguf.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from asyncengine.config import environment


def offline() -> bool:
    """``HF_HUB_OFFLINE`` set, in the environment or in huggingface_hub's constants."""
    from huggingface_hub import constants

    flag = environment.get("HF_HUB_OFFLINE").upper() in ("1", "ON", "YES", "TRUE")
    return flag or bool(constants.HF_HUB_OFFLINE)


@contextlib.contextmanager
def errors_named(name: str, repo: str, revision: str | None, unreachable: str) -> Iterator[None]:
    """Hub failures inside the block as ValueErrors naming the model ``name``: the hub not
    reachable (``unreachable``), no such repository or revision, a failed download."""
    from huggingface_hub.errors import (
        DryRunError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except RepositoryNotFoundError:
        raise ValueError(f"model {repo!r}: no such repository on the hub (or it is gated: "
                         "log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ValueError(f"model {repo!r}: no revision {revision!r} on the hub") from None
    except (LocalEntryNotFoundError, DryRunError):
        raise ValueError(unreachable) from None
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(f"model {name!r}: download failed: {e}") from None
