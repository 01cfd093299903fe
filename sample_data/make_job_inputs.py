"""Small inputs for the example jobs in jobs/: a chat-messages set, a template set, an OpenAI batch file.

Usage: python sample_data/make_job_inputs.py   (writes chat.parquet, articles.parquet, openai_batch.jsonl here)
"""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
QUESTIONS = ["How do I keep basil alive indoors?", "What is a good first programming language?",
             "Why is the sky blue?", "How long should I boil an egg?", "What does a compiler do?",
             "How can I sleep better?", "What is compound interest?", "How do vaccines work?"]
ARTICLES = [("Harbour reopens", "After two years of repairs the old harbour reopened on Monday. Fishing boats "
             "returned at dawn and the market hall was full by noon."),
            ("Library extends hours", "The city library will stay open until ten in the evening from next month, "
             "after a petition signed by four thousand students."),
            ("Heatwave warning", "Forecasters expect temperatures above thirty-five degrees for five days. The "
             "council asks residents to check on elderly neighbours."),
            ("New bike lanes", "Twelve kilometres of protected bike lanes opened along the river. Cycling traffic "
             "rose by a third in the first week."),
            ("School garden wins prize", "A primary school's vegetable garden won the regional award. Pupils grow "
             "beans, squash and herbs for the school kitchen.")]


def main() -> None:
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    chats[1] = [{"role": "user", "content": "I want to learn to code."},
                {"role": "assistant", "content": "Great! What would you like to build?"},
                {"role": "user", "content": "Small web apps. Which language first?"}]
    pq.write_table(pa.table({"conversation_id": [f"c{i:02d}" for i in range(len(chats))],
                             "messages": pa.array(chats, messages)}), os.path.join(HERE, "chat.parquet"))
    pq.write_table(pa.table({"article_id": pa.array(range(1, len(ARTICLES) + 1), pa.int64()),
                             "title": [t for t, _ in ARTICLES], "body": [b for _, b in ARTICLES],
                             "section": ["news", "city", "weather", "city", "schools"]}),
                   os.path.join(HERE, "articles.parquet"))
    with open(os.path.join(HERE, "openai_batch.jsonl"), "w") as f:
        for i, q in enumerate(QUESTIONS[:5]):
            f.write(json.dumps({"custom_id": f"request-{i + 1}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "smollm2-135m", "max_tokens": 48, "temperature": 0,
                                         "messages": [{"role": "system", "content": "Answer in two sentences."},
                                                      {"role": "user", "content": q}]}}) + "\n")
        f.write(json.dumps({"custom_id": "request-6", "method": "POST", "url": "/v1/completions",
                            "body": {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 32,
                                     "temperature": 0.7, "seed": 7, "stop": ["\n\n"]}}) + "\n")


if __name__ == "__main__":
    main()
