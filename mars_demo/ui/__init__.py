"""The Gradio app's parts: everything between the decoding engine and ``app.py``.

Gradio is imported by the modules that handle events or build their values (``handlers.py``,
``outputs.py``, ``serving_tab.py``, ``live_tab.py``, ``hosting.py``, ``messages.py``), plotly only by
``charts.py``; ``sweep.py`` (the tau sweep), ``race.py`` (interleaving and traces), ``render.py``
(escaped HTML for the text panes), ``models.py`` (the shared model cache) and ``examples.py`` are
plain Python, tested without a server.
"""
