"""What the memory tests read from the kernel: the process's resident memory and what the
machine has left."""


def _proc_field(path: str, field: str) -> int:
    with open(path) as lines:
        for line in lines:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{path} has no {field} line")


def resident_anonymous_bytes() -> int:
    """Anonymous resident memory (RssAnon: what malloc and torch hold, not library pages)."""
    return _proc_field("/proc/self/status", "RssAnon")


def available_bytes() -> int:
    """Memory the kernel can give without swapping (MemAvailable)."""
    return _proc_field("/proc/meminfo", "MemAvailable")
