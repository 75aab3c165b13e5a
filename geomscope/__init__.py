"""geomscope: embedding geometry of transformer language models.

In a notebook::

    import geomscope
    rep = geomscope.load_report("run/report.json")   # a dict with .to_frame() and a Jupyter table
    df = rep.to_frame()                               # one row per layer, se_<metric> columns
"""

__version__ = "0.1.0"

__all__ = ["__version__", "load_report"]


def __getattr__(name: str):
    # lazy: `import geomscope` stays cheap (the CLI imports it before every command)
    if name == "load_report":
        from geomscope.report import load_report

        return load_report
    raise AttributeError(f"module 'geomscope' has no attribute {name!r}")
