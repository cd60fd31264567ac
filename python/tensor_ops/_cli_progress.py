"""Progress for python -m tensor_ops on stderr: a rich or tqdm bar when one
is installed and stderr is a terminal, else one plain line per step (what a
CI log wants). Every step that can take more than a second goes through
track(): the first call on a backend (OpenCL program builds, the SYCL JIT),
torch.compile, the timing loops."""
from __future__ import annotations

import sys
import time
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")


def _kind() -> str:
    if not sys.stderr.isatty():
        return "plain"
    for name in ("rich", "tqdm"):
        try:
            __import__(name)
            return name
        except ImportError:
            pass
    return "plain"


def track(items: Iterable[T], desc: str, label: Callable[[T], str] = str) -> Iterator[T]:
    """Yields items, showing desc, the current item's label and the count."""
    items = list(items)
    kind = _kind()
    t0 = time.perf_counter()
    if kind == "rich":
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(desc, total=len(items))
            for item in items:
                bar.update(task, description=f"{desc}: {label(item)}")
                yield item
                bar.advance(task)
    elif kind == "tqdm":
        from tqdm import tqdm

        with tqdm(items, desc=desc, file=sys.stderr, leave=False) as bar:
            for item in bar:
                bar.set_postfix_str(label(item))
                yield item
    else:
        for i, item in enumerate(items):
            print(f"[{desc} {i + 1}/{len(items)}] {label(item)}", file=sys.stderr, flush=True)
            yield item
    print(f"[{desc}] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
