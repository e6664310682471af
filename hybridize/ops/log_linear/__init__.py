"""Log-linear attention op (Fenwick-tree hierarchy of decayed states): `reference` holds the PyTorch
recurrent and chunk forms. See README.md in this folder."""
