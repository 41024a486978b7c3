"""Training DART draft heads: the corpus they learn from and how they are fitted."""
