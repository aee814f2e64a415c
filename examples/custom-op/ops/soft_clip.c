/* SoftClip: y = alpha * tanh(x / alpha), a smooth clip to (-alpha, alpha). */
#include <math.h>

#include "cuvil_op.h"

int soft_clip(const cuvil_op_context *ctx) {
    const cuvil_tensor *x = &ctx->inputs[0], *y = &ctx->outputs[0];
    const cuvil_attr *alpha_attr = cuvil_op_attr(ctx, "alpha");
    if (x->dtype != CUVIL_FLOAT32 || x->rank != 2 || alpha_attr == NULL) return 1;
    const float alpha = (float)alpha_attr->f;
    if (!(alpha > 0.0f)) return 2; /* the model's call raises an error naming the node */
    const float *in = (const float *)x->data;
    float *out = (float *)y->data;
    for (int64_t i = 0; i < x->shape[0]; i++)
        for (int64_t j = 0; j < x->shape[1]; j++)
            out[i * y->strides[0] + j * y->strides[1]] =
                alpha * tanhf(in[i * x->strides[0] + j * x->strides[1]] / alpha);
    return 0;
}
