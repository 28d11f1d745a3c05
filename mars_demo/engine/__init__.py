"""The decoding engine: checkpoint loading, MARS and AR decoders, batching, acceptance and the CPU compute paths.

Depends on torch and transformers only: nothing here imports ``mars_demo.research``,
``mars_demo.ui``, Gradio or plotly (tests/test_layout.py checks).
"""
