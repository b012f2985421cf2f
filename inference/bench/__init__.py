"""`headway bench`: Headway's decoding beside plain decoding and its peers, on prompt sets
(prompts/)."""
