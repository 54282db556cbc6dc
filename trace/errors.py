"""Errors raised before any work is done, each naming what to change."""


class UnsupportedFeature(ValueError):
    """The model, loss or optimizer uses something turnip cannot trace or reproduce exactly."""


class UnsupportedOp(UnsupportedFeature):
    def __init__(self, op: str, module: str, why: str):
        self.op, self.module = op, module
        where = f"module '{module}'" if module else "the loss or backward pass"
        super().__init__(f"op {op} in {where}: {why}")
