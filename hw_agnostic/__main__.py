"""``python -m hw_agnostic demo [...]`` and ``python -m hw_agnostic compile-report [...]``."""

import sys


def main() -> int:
    commands = {
        "demo": ("hw_agnostic.demo", "main"),
        "compile-report": ("hw_agnostic.compile_report", "compile_report_main"),
    }
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(f"usage: python -m hw_agnostic {{{','.join(commands)}}} [--help]", file=sys.stderr)
        return 2
    import importlib

    module, function = commands[sys.argv[1]]
    return getattr(importlib.import_module(module), function)(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
