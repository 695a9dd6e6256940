// The kernels other kernels call (decode_step.cpp's block driver, moe.cpp's expert loop):
// their prototypes, declared once. Each is defined, with its contract, in its own file.
#pragma once

#include <cstdint>

namespace pf {
// The GEMV cpu_ops picked for this CPU (pf_linear_bf16 / _fma / _amx), passed as a pointer.
using GemvFn = int (*)(const void* x, int64_t x_stride, const void* w, const void* bias, void* y,
                       int64_t y_stride, int M, int64_t N, int64_t K, int nthreads);

// Decode attention's AMX tiles (attention_amx.cpp; attention.cpp calls them): begin configures
// this thread's tiles for G heads of D (false: no AMX here or an unsupported shape), end
// releases them; pack_q lays a kv head's G query rows out as the tile product's B operand
// (G * D bf16); scores writes the 16 x G float32 dot products of 16 K rows stride elements
// apart with the packed queries.
bool decode_amx_begin(int G, int D);
void decode_amx_end();
void decode_amx_pack_q(const uint16_t* q, int G, int D, uint16_t* qv);
void decode_amx_scores(const uint16_t* k, int64_t stride, const uint16_t* qv, int G, int D,
                       float* c);
// pv: acc (G x D float32) += P (G x 32, bf16 values held as float) . V (32 rows; nullptr:
// zeros).
void decode_amx_pv(const uint16_t* const* v, const float* p, int G, int D, float* acc);
}  // namespace pf

extern "C" {
int pf_amx_ready();  // gemv_amx.cpp: the OS granted the AMX tile state
int pf_rms_norm(int dtype, const void* x, int64_t x_stride, void* res, int64_t res_stride,
                const void* w, void* out, int64_t out_stride, int64_t N, int D, float eps,
                int zero_centered, int nthreads);
int pf_qk_norm_rope(int dtype, const void* qkv, int64_t row_stride, int64_t q_off,
                    int64_t q_head_stride, int64_t k_off, const int64_t* positions,
                    const float* cos, const float* sin, int rot, const void* qw, const void* kw,
                    float eps, int zero_centered, void* q_out, void* k_out, int64_t N, int H,
                    int KVH, int D, int nthreads);
int pf_write_kv(int dtype, const void* k, const void* v, int64_t k_stride, int64_t v_stride,
                const int64_t* slots, void* cache, int N, int KVH, int D);
int pf_decode_attention(int dtype, const void* q, int64_t q_stride, const int64_t* rows,
                        const void* cache, const int64_t* tables, int64_t table_stride,
                        const int64_t* seq_lens, const int64_t* kv_starts, void* out,
                        int64_t out_stride, int B, int H, int KVH, int D, int bs, float scale,
                        int nthreads);
int pf_argmax_bf16(const void* x, int64_t M, int64_t N, int64_t ld, int64_t* out);
int pf_silu_mul(int dtype, const void* gu, int64_t stride, void* out, int64_t N, int I,
                int nthreads);
int pf_relu2(int dtype, const void* x, int64_t stride, void* out, int64_t N, int I,
             int nthreads);
int pf_mamba2_decode(int dtype, void* raw, int64_t page_bytes, const int64_t* pages, int P,
                     int64_t conv_off, int64_t ssm_off, const uint8_t* fresh, const void* xbc,
                     int64_t x_stride, const void* dt, int64_t dt_stride, const void* conv_w,
                     const void* conv_b, const float* dt_bias, const float* A, const float* D,
                     void* y, int64_t N, int C, int K, int H, int Dh, int G, int Ns,
                     int nthreads);
int pf_sigmoid_gate(int dtype, const void* o, int64_t os, const void* g, int64_t gs,
                    int64_t ghs, void* out, int64_t outs, int64_t N, int H, int D, int nthreads);
int pf_gdn(int dtype, int ssm_dtype, void* raw, int64_t page_bytes, const int64_t* pages, int P,
           int64_t conv_off, int64_t ssm_off, const uint8_t* fresh, const int64_t* cu,
           const void* x, int64_t x_stride, const void* a, const void* b, int64_t ab_stride,
           const void* conv_w, const float* neg_exp_alog, const void* dt_bias, void* out,
           int64_t N, int C, int K, int Hk, int Hv, int Dk, int Dv, float scale,
           const int64_t* cap_cu, const int64_t* cap_off, const int64_t* cap_pages,
           int nthreads);
int pf_rms_norm_gated(int dtype, const void* x, int64_t xs0, int64_t xs1, const void* gate,
                      int64_t gs0, int64_t gs1, const void* w, void* out, int64_t N, int H, int D,
                      float eps, int nthreads);
int pf_gated_norm_gate_first(int x_dtype, int g_dtype, int w_dtype, const void* x, int64_t xs,
                             const void* gate, int64_t gs, const void* w, void* out, int64_t N,
                             int D, int group, float eps, int nthreads);
int pf_lora_shrink(int dtype, const void* x, int64_t xs, const void* a, const int64_t* idx,
                   float* v, int64_t N, int R, int K, int nthreads);
int pf_lora_expand(int dtype, void* y, int64_t ys, const float* v, const void* b,
                   const int64_t* idx, int64_t N, int O, int R, int nthreads);
int pf_moe_experts_few(void* gemv_gu, void* gemv_down, const uint16_t* x, int64_t x_stride,
                       int t, int k, const int64_t* top_idx, const uint16_t* top_w,
                       const uint16_t* gate_up, const uint16_t* down, int E, int64_t hidden,
                       int64_t inter, uint16_t* out, int nthreads);
int pf_moe_experts_grouped(void* gemv_gu, void* gemv_down, const uint16_t* x, int64_t x_stride,
                           int k, const int64_t* order, const int64_t* starts, int E,
                           int min_rows, int max_rows, const uint16_t* gate_up,
                           const uint16_t* down, int64_t hidden, int64_t inter, uint16_t* ys,
                           int nthreads);
int pf_moe_combine(const int64_t* rows_at, const int64_t* order, int t, int k,
                   const uint16_t* top_w, int64_t hidden, uint16_t* out, int nthreads);
int pf_moe_route(const uint16_t* logits, int64_t stride, int t, int E, int k, int norm,
                 int64_t* idx, uint16_t* w, int nthreads);
int pf_moe_shared_add(const uint16_t* routed, const uint16_t* shared, const uint16_t* gate,
                      int64_t gate_stride, uint16_t* out, int64_t t, int64_t d, int nthreads);
// The quantized few-row products (gguf_quant.cpp, qgemv_q8.cpp, qgemm_amx.cpp, quant.cpp):
// float32 rows.
int pf_qgemv_affine(const float* x, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
                    int32_t bits, int64_t group, const void* scale, const void* mins,
                    int32_t half, float* y, int64_t ldy, int32_t nthreads);
int pf_qgemv_affine_q8(const float* x, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
                       int32_t bits, int64_t group, const void* scale, const void* mins,
                       int32_t half, float* y, int64_t ldy, int32_t nthreads);
int pf_qgemm_affine_q8(const float* x, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
                       int32_t bits, int64_t group, const void* scale, const void* mins,
                       int32_t half, float* y, int64_t ldy, int32_t nthreads);
int pf_affine_decode_bf16(const uint8_t* codes, int32_t bits, int64_t group, const void* scale,
                          const void* mins, int32_t half, int64_t n, int64_t k, uint16_t* out,
                          int64_t ldo, int32_t nthreads);
int pf_qgemv_int(const float* x, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
                 int32_t bits, int32_t fp8, int64_t group, const float* scale,
                 const float* zero, float* y, int64_t ldy, int32_t nthreads);
}  // extern "C"
