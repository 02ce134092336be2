"""The Hugging Face Hub client: pinned downloads with resume (`download`, `fetch`), the offline view of a
folder or the HF cache (`local`), and the integrity records and checks of every file (`integrity`).

May import `store` (to read shard headers), `errors` and `progress`.
"""
