"""python devscripts/runwith.py MODULE.ATTR=VALUE ... -- vlora args: the CLI with module constants set first."""
import importlib, runpy, sys
i = sys.argv.index("--")
for item in sys.argv[1:i]:
    name, value = item.split("=", 1)
    mod, attr = name.rsplit(".", 1)
    setattr(importlib.import_module(mod), attr, eval(value))
sys.argv = ["vlora"] + sys.argv[i + 1:]
runpy.run_module("vlora", run_name="__main__")
