//! The KV cache of greedy decoding: each layer's keys and values of the tokens already
//! decoded, so a step feeds only the new token.
use tch::Tensor;

/// Keys and values of the tokens a sequence has already been through, per layer, so that
/// decoding feeds only the new tokens instead of recomputing the whole prefix.
///
/// Keys are kept after RoPE and before grouped-query attention repeats them (the smaller
/// form). Each step concatenates, which copies the cache: simple, and cheap next to the
/// forward pass at the context lengths this is used for. Batches must be unpadded.
#[derive(Debug, Default)]
pub struct KvCache {
    /// `(k, v)` per layer, each `[B, H_kv, len, D]`.
    layers: Vec<(Tensor, Tensor)>,
    len: i64,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Tokens already cached: the position of the next token fed.
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the cached keys and values.
    pub fn nbytes(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(|(k, v)| [k, v])
            .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }

    /// Appends layer `layer`'s keys/values for the new tokens and returns the whole
    /// sequence's. The length only advances once every layer has run
    /// ([`crate::model::Model::forward_cached`], which then calls [`KvCache::set_len`]).
    pub(crate) fn extend(&mut self, layer: usize, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        match self.layers.get_mut(layer) {
            Some(slot) => {
                let k = Tensor::cat(&[&slot.0, &k], 2);
                let v = Tensor::cat(&[&slot.1, &v], 2);
                *slot = (k.shallow_clone(), v.shallow_clone());
                (k, v)
            }
            None => {
                self.layers.push((k.shallow_clone(), v.shallow_clone()));
                (k, v)
            }
        }
    }

    /// Drops everything after the first `len` tokens (undoes a failed forward's appends).
    pub(crate) fn truncate(&mut self, len: i64) {
        if len == 0 {
            self.layers.clear();
        } else {
            for (k, v) in &mut self.layers {
                if k.size()[2] > len {
                    *k = k.narrow(2, 0, len);
                    *v = v.narrow(2, 0, len);
                }
            }
        }
        self.len = len;
    }

    /// The sequence length once every layer has appended a forward's tokens.
    pub(crate) fn set_len(&mut self, len: i64) {
        self.len = len;
    }
}
