//! `ChannelsFirst`: an 8-bit `[N, H, W, C]` tensor moved to `[N, C, H, W]`.
//! A TensorFlow-exported model takes its image channels-last and moves it
//! to NCHW for its first convolution; tract runs that move with its
//! generic axis op, element by element (vww: 20 us for a 96 x 96 x 3 image,
//! as long as its first convolution). `passes::after_declutter` puts this
//! op, which moves 16 pixels a step (`transpose::image_to_channels_first`),
//! in its place.

use super::transpose::image_to_channels_first;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChannelsFirst;

impl ChannelsFirst {
    /// Whether it can replace a move of `fact`: rank 4, one byte a value.
    pub fn fits(fact: &TypedFact) -> bool {
        fact.rank() == 4 && fact.datum_type.size_of() == 1 && fact.datum_type.is_copy()
    }
}

impl Op for ChannelsFirst {
    fn name(&self) -> StaticName {
        "edgeinfer.ChannelsFirst".into()
    }

    op_as_typed_op!();
}

impl EvalOp for ChannelsFirst {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let input = &inputs[0];
        let &[n, h, w, c] = input.shape() else {
            anyhow::bail!("ChannelsFirst: input of shape {:?}", input.shape())
        };
        let bytes = super::requant::bytes_of(input)?;
        // SAFETY: i8 and u8 share width, alignment and every bit pattern.
        let x = unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const i8, bytes.len()) };
        let mut out = Tensor::zero::<i8>(&[n, c, h, w])?;
        let image = h * w * c;
        {
            let mut view = out.try_as_plain_ram_mut()?;
            for (x, y) in x.chunks(image.max(1)).zip(view.as_slice_mut::<i8>()?.chunks_mut(image.max(1))) {
                image_to_channels_first(x, c, h * w, y);
            }
        }
        // Same bytes; the input's type (and its quantization) carries over.
        unsafe { out.set_datum_type(input.datum_type()) };
        Ok(tvec!(out.into_tvalue()))
    }
}

impl TypedOp for ChannelsFirst {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let fact = inputs[0];
        anyhow::ensure!(ChannelsFirst::fits(fact), "ChannelsFirst: input {fact:?}");
        let s = &fact.shape;
        Ok(tvec!(fact.datum_type.fact(tvec![s[0].clone(), s[3].clone(), s[1].clone(), s[2].clone()])))
    }

    as_op!();
}
