"""CCQ covariance read and query cleaning: `reference` (the read, PyTorch), `clean` (the cleaning, PyTorch),
`triton_read` / `triton_clean` (Triton, loaded lazily on CUDA). See README.md."""
