"""Headway's recipes (YAML run configs), shipped with the package so that `headway demo` finds its own."""
