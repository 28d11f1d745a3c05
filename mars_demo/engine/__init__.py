"""The decoding engine, in rooms by reason to change: decoding/ (the method), backends/ (how a pass runs),
checkpoints/ (what a model is and where it comes from), serving/ (many requests); docs/ARCHITECTURE.md.

Depends on torch and transformers only: nothing here imports ``mars_demo.research``,
``mars_demo.ui``, Gradio or plotly (tests/test_layout.py checks).
"""
