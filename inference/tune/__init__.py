"""`headway tune`: the tree each head kind can use (spaces.py), scored by replaying greedy answers
(replay.py) and priced by the cost model, saved in the head's tuned.json."""
