"""`archc report`: one self-contained HTML page of a compile — the spec, the pass pipeline drawn
pass by pass, the kernels, their roofline and validation — and the JSON it is a view of
(``data``: the numbers; ``layout``: where nodes are drawn; ``page``: the HTML)."""
