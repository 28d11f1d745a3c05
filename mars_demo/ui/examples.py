"""Example prompts for the app: varied kinds of request (explanation, code, arithmetic, story, email...)."""

from __future__ import annotations

EXAMPLE_PROMPTS: tuple[str, ...] = (
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a haiku about autumn leaves.",
    "A farmer has 17 sheep and buys 5 more. How many sheep does he have now? Explain step by step.",
    "Give three tips for staying focused while studying.",
    "Write a short, polite email asking a colleague to review my report by Friday.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Write a SQL query that returns the ten most recent orders from a table called orders.",
    "Tell me a short story about a robot who learns to paint.",
    "List the planets of the solar system in order from the Sun.",
)
