from dflash.engine.native import build

print(f"built {build()}")
