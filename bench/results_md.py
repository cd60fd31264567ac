"""bench/RESULTS.md: each benchmark run owns a section, marked by HTML
comments with its key and sort order; a rerun replaces its section, and the
sections stay sorted (ops, then latency, then the pool)."""
from __future__ import annotations

import datetime
import os
import pathlib
import re
import subprocess

RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"
HEADER = """# Benchmark results

Written by the scripts in `bench/` (see `bench/README.md`); each section is
replaced when its benchmark runs again (text written by hand belongs above the
first section). Machines are shared and noisy: compare ratios within one
section, and treat differences under ~20% as noise; the load average at the
start of each section shows how busy the machine was.
"""
SECTION = re.compile(r"<!-- begin (.+?) \[order (.*?)\] -->\n.*?<!-- end \1 -->\n?", re.S)


def machine() -> str:
    """One line: date, CPU model, hypervisor, cores, load average."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    model = fields.get("Model name", "unknown CPU").strip()
    hyper = fields.get("Hypervisor vendor", "").strip()
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"{date} · {model}{f' under {hyper}' if hyper else ''}, {os.cpu_count()} cores · "
            f"load average {load} (1/5/15 min) at start")


def write_section(key: str, order: str, markdown: str) -> pathlib.Path:
    """Puts `markdown` into RESULTS.md as the section `key`, replacing the
    old one; sections are sorted by `order` (compared as strings)."""
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    sections = {m.group(1): (m.group(2), m.group(0).rstrip("\n")) for m in SECTION.finditer(text)}
    first = SECTION.search(text)
    head = text[:first.start()] if first else text
    sections[key] = (order, f"<!-- begin {key} [order {order}] -->\n{markdown.strip()}\n<!-- end {key} -->")
    body = "\n\n".join(block for _, block in sorted(sections.values()))
    RESULTS.write_text(head.rstrip("\n") + "\n\n" + body + "\n")
    return RESULTS
