"""turnip: train a PyTorch step bigger than the GPU, with eager PyTorch's numbers.

    from turnip import memgraph, engine
    mg = memgraph.compile(model, loss_fn, batch, optimizer=opt, budget="6GiB")
    out = engine.run(mg, batch)
"""

__version__ = "0.1.0"
