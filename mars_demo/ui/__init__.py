"""The Gradio app's parts: everything between the decoding engine and ``app.py``.

Only ``handlers.py`` and ``serving.py`` (the Serving tab's Run and Stop) import Gradio,
and only ``charts.py`` imports plotly; ``sweep.py``
(the tau sweep), ``race.py`` (interleaving and traces), ``render.py`` (escaped HTML
for the text panes), ``models.py`` (the shared model cache) and ``examples.py`` are
plain Python, tested without a server.
"""
