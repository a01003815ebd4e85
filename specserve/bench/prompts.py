"""Chat prompts used when ``specserve bench`` is given no prompt file, and by the benchmark scripts
(general topics: prose, code, lists, explanations)."""

DEFAULT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works and when to use one.",
    "Give me a recipe for a simple tomato soup.",
    "What are the main causes of the French Revolution?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Describe the water cycle for a school science class.",
    "List five tips for writing clear emails.",
    "Why is the sky blue? Explain it simply.",
    "Write a haiku about mountains.",
    "Compare cats and dogs as pets.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Summarise the plot of Romeo and Juliet.",
    "What is the difference between weather and climate?",
    "Give three arguments for learning a second language.",
    "Write a SQL query that counts orders per customer.",
    "Explain recursion to a beginner.",
]

CHATS = DEFAULT_PROMPTS
