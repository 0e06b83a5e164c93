"""The packaged training corpus: a few kilobytes of plain English prose, written for tensorpar
(no third-party text), so that ``tensorpar train`` runs offline with no ``--data``."""

CORPUS = """\
A large model does not fit on one device, so its weight matrices are cut into pieces and each
device keeps one piece. The pieces work at the same time, and a few collective operations put
their results back together. This is tensor parallelism, and the whole art of it is to cut the
matrices so that the devices talk as little as possible.

Take the two matrices of a transformer's feed-forward block. The first one is cut by columns:
every device multiplies the same input by its own slice of columns and obtains its own slice of
the hidden activations. The activation function works on each slice alone, so nothing has to
move. The second matrix is cut by rows, to match: every device multiplies its slice of the
hidden activations by its slice of rows and obtains a partial sum of the whole output. One
all-reduce adds the partial sums, and every device holds the output of the block.

Attention is cut by heads. Each head has its own queries, keys and values, so a device that
holds a few heads computes their attention without asking anyone. The output projection is cut
by rows, and again one all-reduce finishes the block. A model with eight heads splits over one,
two, four or eight devices; over three it does not split evenly, and a careful tool says so
before anything runs.

Data parallelism is the older idea. Every device holds the whole model and reads its own part
of the batch; after the backward pass the gradients are averaged, and every copy of the model
takes the same step. The two ideas combine on a grid of devices: tensor parallelism inside a
row of the grid, where the links are fast, and data parallelism across the rows, where they
are slow. When memory is short, the copies of the data-parallel dimension can each keep only a
share of the weights, the gradients and the optimizer's state, and gather the rest just before
it is needed.

Training on such a grid must give the same numbers as training on one device. The loss of a
step is the mean over every token of the global batch; each data-parallel rank computes the
mean over its own rows, and the average of those means is the global mean when the rows are
shared out evenly. The gradient norm used for clipping counts every parameter exactly once,
whether a device holds it whole, holds a shard of it, or holds one of several identical
copies. With these rules kept, the curve of the loss does not depend on the grid.

A checkpoint written in the middle of a run must let the run continue as if it had never
stopped. The weights and the optimizer's moments are written as pieces of the dense tensors,
each device writing what it holds, so a run saved on one grid can resume on another. The
batches are drawn from the number of the step and a seed, never from a stream that a restart
would lose, so the resumed run reads exactly what the uninterrupted run would have read.

The lighthouse keeper wrote in his log every evening. The wind came from the west at noon and
turned north before dark. Three boats passed the point, two of them heading for the harbour and
one out to sea. The lamp was lit at seven and trimmed at midnight. The glass fell a little in
the small hours, and by morning the rain had come. He mended the shutter on the east window,
fed the hens, and carried oil up the stairs, one hundred and twelve steps, counting each one.

In the market the baker sold bread by the loaf and by the half, and the fishmonger weighed
each catch on a brass scale that had belonged to her grandmother. Children ran between the
stalls. An old man played the same four songs on an accordion, and people dropped coins into
his hat without listening. At one o'clock the bells rang, the awnings came down, and the
square was quiet again until the next morning.

Numbers have their own weather. Add a long column of small numbers in one order and you get
one answer; add them in another order and the last digit may change. Neither answer is wrong:
each is the exact sum rounded a little differently. This is why a split model is compared with
the unsplit one in double precision, where the rounding is so small that any real mistake
stands out by many orders of magnitude.
"""
