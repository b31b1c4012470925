"""Frontends: ONNX files (onnx.py) and torch.nn.Modules through torch.export (fx.py) lower into
the same IR."""
