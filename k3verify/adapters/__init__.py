"""Optional third-party implementations, each import-guarded so k3verify runs without them."""
