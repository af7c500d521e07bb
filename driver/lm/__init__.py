"""lm-eval models and the request path: `mlx`, `mlx-ray`, tokenization, the result cache, the progress bar."""
