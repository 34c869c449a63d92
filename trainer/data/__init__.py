"""Training data: the zero-set-up demo corpus (demo.py), prepared token datasets (format.py, written by
`python -m trainer.data prepare`), and the order in which a run reads them (order.py)."""
