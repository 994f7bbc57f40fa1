"""Hypothesis strategies, one module per k3verify module plus shared building blocks.

Every strategy shrinks toward small shapes (sizes are drawn with small minimums first).
"""
