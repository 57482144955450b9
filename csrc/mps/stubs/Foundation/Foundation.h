// Stub of <Foundation/Foundation.h>: see ../README.md.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include <Availability.h>  // the SDK generation's (../MacOSX<N>.sdk)
#include <dispatch/dispatch.h>
#include <os/availability.h>

// <objc/objc.h>
#ifndef nil
#define nil nullptr
#endif
#ifndef Nil
#define Nil nullptr
#endif
typedef signed char BOOL;
#define YES ((BOOL)1)
#define NO ((BOOL)0)
typedef long NSInteger;
typedef unsigned long NSUInteger;
typedef NSUInteger NSStringEncoding;
#define NS_ENUM(_type, _name) enum _name : _type _name; enum _name : _type
#define NS_OPTIONS(_type, _name) enum _name : _type _name; enum _name : _type

@protocol NSObject
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject> {
  Class isa;
}
+ (instancetype)alloc;
+ (instancetype)new;
- (instancetype)init;
@end

@interface NSString : NSObject
+ (nullable instancetype)stringWithUTF8String:(const char* _Nonnull)nullTerminatedCString;
@property(nullable, readonly) const char* UTF8String;
@end

@interface NSError : NSObject
@property(readonly, copy) NSString* _Nonnull localizedDescription;
@end

@interface NSDictionary<KeyType, ObjectType> : NSObject
@end

// NSProcessInfo.h
typedef struct {
  NSInteger majorVersion;
  NSInteger minorVersion;
  NSInteger patchVersion;
} NSOperatingSystemVersion;

@interface NSProcessInfo : NSObject
@property(class, readonly, strong) NSProcessInfo* _Nonnull processInfo;
@property(readonly) NSOperatingSystemVersion operatingSystemVersion
    API_AVAILABLE(macos(10.10), ios(8.0), watchos(2.0), tvos(9.0));
@end
