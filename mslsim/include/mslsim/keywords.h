// mslsim: MSL address-space and function qualifiers as C++ macros.
// Included after the prelude, right before the (preprocessed) kernel source.
#pragma once
#define kernel
#define vertex
#define fragment
#define device
#define thread
#define threadgroup
#define constant const
#define ray_data
#define object_data
